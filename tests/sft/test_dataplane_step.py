"""``dataplane.enabled`` in SFT: the controller sends each step's rows as row numbers of the data
file and each rank collates its own rows there; every metric equals today's ``Batch`` path step for step on a fixed
seed, the controller serialises no batch payload, and no block is left once a step returned."""

import pytest

from tandem.config.overrides import config_from_overrides
from tandem.dpo import DPOConfig
from tandem.models import save_tiny_model
from tandem.sft import SFTConfig, SFTTrainer
from tests.sft.step_counting import CountingSteps, measured
from tests.sft.test_sft import addition_conversations, write_jsonl


class CountingSFT(CountingSteps, SFTTrainer):
    pass


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft-dataplane")
    return {
        "model": str(save_tiny_model(root / "model")),
        "train": write_jsonl(root / "train.jsonl", addition_conversations(24, 0)),
        "val": write_jsonl(root / "val.jsonl", addition_conversations(6, 1)),
    }


def run(files, out, *overrides):
    config = config_from_overrides(
        SFTConfig,
        [
            f"model_path={files['model']}",
            f"data.train_path={files['train']}",
            f"data.val_path={files['val']}",
            "trainer.global_batch_size=4",
            "trainer.total_steps=3",
            "trainer.log_every=100",
            "trainer.report=false",
            "engine.lr=3e-3",
            "engine.max_tokens_per_micro_batch=64",  # several micro-batches a step
            f"trainer.output_dir={out}",
            *overrides,
        ],
    )
    trainer = CountingSFT(config)
    return trainer.fit(), trainer


def test_in_process_sft_on_references_matches_the_batch_path_and_releases_its_blocks(sft_files, tmp_path):
    """The fast sibling: one in-process worker (the controller's process), 3 steps and an evaluation."""
    _, today = run(sft_files, tmp_path / "off", "dataplane.enabled=false")
    _, refs = run(sft_files, tmp_path / "on", "dataplane.enabled=true")
    assert measured(refs.record.history) == measured(today.record.history)
    assert "eval_loss" in refs.record.history[-1]
    assert [t.blocks_put for t in today.step_traffic] == [0, 0, 0]
    # the rank collated its rows from the file: nothing put, fetched or left, by anyone
    assert [(t.blocks_put, t.put_bytes, t.fetched_bytes) for t in refs.step_traffic] == [(0, 0, 0)] * 3
    assert refs.step_bytes == [0, 0, 0] and refs.left == [[], [], []]


@pytest.mark.slow  # two 3-step runs over 2 spawned workers
def test_sft_on_references_over_two_ranks_moves_no_payload_through_the_controller(sft_files, tmp_path):
    _, today = run(sft_files, tmp_path / "off", "dataplane.enabled=false", "trainer.n_workers=2")
    _, refs = run(sft_files, tmp_path / "on", "trainer.n_workers=2", "dataplane.enabled=true")
    assert measured(refs.record.history) == measured(today.record.history)
    print(f"controller batch bytes per step: today {today.step_bytes}, refs {refs.step_bytes}")
    assert all(b > 0 for b in today.step_bytes)  # today: the batch to the update and the probe
    assert refs.step_bytes == [0, 0, 0]
    # the controller put nothing (it put the batch once a step before): each rank collated its rows
    assert [(t.blocks_put, t.put_bytes, t.fetched_bytes) for t in refs.step_traffic] == [(0, 0, 0)] * 3
    assert refs.left == [[], [], []]


def test_the_ray_engine_without_the_ray_backend_is_refused_naming_both_keys(sft_files):
    for config_class in (SFTConfig, DPOConfig):
        with pytest.raises(
            ValueError, match=r"dataplane.engine=ray needs trainer.backend=ray \(got trainer.backend=local\)"
        ):
            config_from_overrides(
                config_class,
                [f"model_path={sft_files['model']}", f"data.train_path={sft_files['train']}",
                 "dataplane.enabled=true", "dataplane.engine=ray"],
            )  # fmt: skip
