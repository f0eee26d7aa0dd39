"""``dataplane.enabled`` in DPO and KTO: the controller sends each step's pairs as file rows and
per-row scalars, each rank collates its own rows from the data file, the reference's scores come
back from the ranks with the rows (per-row scalars, inline); every metric equals today's ``Batch`` path step for step on a
fixed seed, the controller serialises no batch payload, and no block is left once a step returned."""

import pytest

from tandem.dpo import preference_trainer
from tests.dpo.conftest import addition_pairs, dpo_config, write_jsonl
from tests.dpo.test_kto_orpo import unpaired_rows
from tests.sft.step_counting import CountingSteps, measured


@pytest.fixture(scope="module")
def files(dpo_files, tmp_path_factory):
    """Small pair and unpaired-row files: 2 steps of 4 and a validation of one batch."""
    root = tmp_path_factory.mktemp("dpo-dataplane")
    return {
        **dpo_files,  # dpo_config names their model and files; the overrides below replace the files
        "pairs": write_jsonl(root / "pairs.jsonl", addition_pairs(8, seed=0)),
        "pairs_val": write_jsonl(root / "pairs_val.jsonl", addition_pairs(2, seed=1)),
        "rows": write_jsonl(root / "rows.jsonl", unpaired_rows(4, seed=2)),
        "rows_val": write_jsonl(root / "rows_val.jsonl", unpaired_rows(1, seed=3)),
    }


def run(files, out, *overrides):
    """A 2-step run (DPO, or KTO with ``preference.name=kto``) recording each step's traffic."""
    unpaired = "preference.name=kto" in overrides
    data = ("rows", "rows_val") if unpaired else ("pairs", "pairs_val")
    config = dpo_config(
        files,
        out,
        f"data.train_path={files[data[0]]}",
        f"data.val_path={files[data[1]]}",
        "trainer.global_batch_size=4",
        "trainer.total_steps=2",
        "trainer.report=false",
        *overrides,
    )
    trainer_class = type(preference_trainer(config))  # DPOTrainer or KTOTrainer
    trainer = type(f"Counting{trainer_class.__name__}", (CountingSteps, trainer_class), {})(config)
    trainer.fit()
    return trainer


CASES = [
    pytest.param(("reference=model",), id="sigmoid-reference-model"),
    pytest.param(  # the reference precomputed on the controller's table; pairs packed
        ("engine.use_packing=true", "engine.max_tokens_per_micro_batch=80"),
        id="sigmoid-precompute-packed",
        marks=pytest.mark.slow,  # about as long as the fast case again, which covers the path
    ),
    pytest.param(
        ("preference.name=kto", "reference=model"), id="kto-reference-model", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize("overrides", CASES)
def test_in_process_dpo_on_references_matches_the_batch_path_and_releases_its_blocks(
    files, tmp_path, overrides
):
    """The fast sibling: one in-process worker (the controller's process), 2 steps and a validation."""
    today = run(files, tmp_path / "off", "dataplane.enabled=false", *overrides)
    refs = run(files, tmp_path / "on", "dataplane.enabled=true", *overrides)
    assert measured(refs.record.history) == measured(today.record.history)
    assert "eval_loss" in refs.record.history[-1]
    assert [t.blocks_put for t in today.step_traffic] == [0, 0]
    # the rank collated its rows from the file and the reference's scores are per-row scalars
    # that come back inline: nothing put, fetched or left, by anyone
    assert [(t.blocks_put, t.put_bytes, t.fetched_bytes) for t in refs.step_traffic] == [(0, 0, 0)] * 2
    assert refs.step_bytes == [0, 0] and refs.left == [[], []]


@pytest.mark.slow  # two 2-step runs over 2 spawned workers
def test_dpo_on_references_over_two_ranks_moves_no_payload_through_the_controller(files, tmp_path):
    today = run(files, tmp_path / "off", "dataplane.enabled=false", "reference=model", "trainer.n_workers=2")
    refs = run(files, tmp_path / "on", "reference=model", "trainer.n_workers=2", "dataplane.enabled=true")
    assert measured(refs.record.history) == measured(today.record.history)
    print(f"controller batch bytes per step: today {today.step_bytes}, refs {refs.step_bytes}")
    assert all(b > 0 for b in today.step_bytes)  # today: the pairs to the reference pass and the update
    assert refs.step_bytes == [0, 0]
    # the controller put nothing (it put the pairs once a step before): each rank collated its rows
    assert [(t.blocks_put, t.put_bytes, t.fetched_bytes) for t in refs.step_traffic] == [(0, 0, 0)] * 2
    assert refs.left == [[], []]
