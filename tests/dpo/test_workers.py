"""SFT and DPO on several workers equal one worker: the same losses, metrics, validation and
every step's gradients, and exported weights within the Adam bound of those gradients (DDP,
FSDP2, Ulysses sequence, tensor and expert parallelism, each worker a spawned process)."""

import pytest

from tandem.engine import EngineConfig
from tandem.models import TinyModelConfig, save_tiny_model
from tandem.sft import SFTConfig, SFTDataConfig, SFTTrainerConfig
from tests.dpo.conftest import dpo_config, write_jsonl
from tests.sft.recorded_gradients import RecordingDPOTrainer, RecordingSFTTrainer, assert_same_steps
from tests.sft.test_sft import addition_conversations


def assert_same_history(left: list[dict], right: list[dict], skipped: tuple[str, ...] = ()):
    """Equal step metrics, but for timings and the prefixes ``skipped``."""
    assert len(left) == len(right)
    for one, two in zip(left, right, strict=True):
        assert one.keys() == two.keys()
        for name, value in one.items():
            if name.startswith(("timing_s", "perf/", *skipped)):
                continue
            assert two[name] == pytest.approx(value, rel=1e-4, abs=1e-6), (one["step"], name)


@pytest.mark.parametrize(
    "overrides",
    [
        ("engine.strategy=single",),  # DDP over the two workers
        ("engine.strategy=fsdp2", "reference=model"),  # sharded policy, a frozen reference per worker
        # the meshes below are compared with one process in tests/engine too: slow tier here
        pytest.param(  # one row split over both workers (Ulysses)
            ("engine.strategy=single", "engine.sp_size=2"), id="sequence-parallel", marks=pytest.mark.slow
        ),
        pytest.param(  # weights split, the reference's too
            ("engine.strategy=single", "engine.tp_size=2", "reference=model"),
            id="tensor-parallel-reference-model", marks=pytest.mark.slow,
        ),  # fmt: skip
        pytest.param(  # a tiny MoE's experts split
            ("engine.strategy=single", "engine.ep_size=2", "reference=model"),
            id="expert-parallel-reference-model", marks=pytest.mark.slow,
        ),  # fmt: skip
    ],
    ids=["ddp", "fsdp2-reference-model", "sequence-parallel", "tensor-parallel-reference-model",
         "expert-parallel-reference-model"],  # fmt: skip
)
def test_dpo_on_two_workers_equals_one(dpo_files, tmp_path, overrides):
    model = ()
    if "engine.ep_size=2" in overrides:  # the frozen reference splits its experts like the policy
        moe = save_tiny_model(tmp_path / "moe", TinyModelConfig(family="qwen2_moe"))
        model = (f"model_path={moe}",)
    mesh_keys = ("engine.sp_size", "engine.tp_size", "engine.ep_size")
    trainers = [
        RecordingDPOTrainer(
            dpo_config(
                dpo_files, tmp_path / f"workers{workers}", f"trainer.n_workers={workers}", "trainer.total_steps=3",
                "preference.rpo_alpha=0.5", *model,
                *(o for o in overrides if workers == 2 or not o.startswith(mesh_keys)),
            )
        )
        for workers in (1, 2)
    ]  # fmt: skip
    one, two = (trainer.fit() for trainer in trainers)
    # the routing metrics are each micro-batch's means, and two workers' micro-batches hold half
    # the rows: they are checked for range only (1/E balanced .. 1/k: one expert in every top-k)
    assert_same_history(one.history, two.history, skipped=("moe/",))
    if model:
        assert all(0.25 <= step["moe/load_max_share"] <= 0.5 for step in (*one.history, *two.history))
    assert two.validation["eval_rewards/accuracies"] == pytest.approx(
        one.validation["eval_rewards/accuracies"]
    )
    # the gradients agree to rounding; the weights within the Adam bound of those gradients (tensor
    # parallelism's reordered rounding, where a gradient is near zero, grows into the update)
    print(assert_same_steps(
        (one.output_dir, one.hf_model_dir), (two.output_dir, two.hf_model_dir), trainers[1].engine_config, 3
    ))  # fmt: skip


@pytest.mark.parametrize(
    "mesh",
    [  # sequence and tensor parallelism are compared with one process in tests/engine too: slow tier here
        {},
        pytest.param({"sp_size": 2}, marks=pytest.mark.slow),
        pytest.param({"tp_size": 2}, marks=pytest.mark.slow),
        {"ep_size": 2},
    ],
    ids=["data-parallel", "sequence-parallel", "tensor-parallel", "expert-parallel"],
)
def test_sft_on_two_workers_equals_one(dpo_files, tmp_path, mesh):
    """DDP over the two workers; or one data-parallel rank of two, both handed every row, which
    they split along the sequence (``sp_size``) or split each layer's weights for (``tp_size``,
    ``single``: one tensor-parallel group), one of them reporting; or a tiny Qwen2-MoE whose
    experts the two data-parallel workers split (``ep_size``), each half of every MoE layer's."""
    train = write_jsonl(tmp_path / "train.jsonl", addition_conversations(24, 4))
    val = write_jsonl(tmp_path / "val.jsonl", addition_conversations(6, 5))
    model = dpo_files["model"]
    if "ep_size" in mesh:
        model = str(save_tiny_model(tmp_path / "moe", TinyModelConfig(family="qwen2_moe")))
    results = []
    for workers in (1, 2):
        config = SFTConfig(
            model_path=model,
            data=SFTDataConfig(train_path=train, val_path=val),
            engine=EngineConfig(lr=3e-3, max_tokens_per_micro_batch=128, **(mesh if workers == 2 else {})),
            trainer=SFTTrainerConfig(
                global_batch_size=8,
                total_steps=3,
                eval_every=3,
                n_workers=workers,
                output_dir=str(tmp_path / f"workers{workers}"),
            ),
        )
        results.append(RecordingSFTTrainer(config).fit())
    one, two = results
    assert two.train_losses == pytest.approx(one.train_losses, rel=1e-5)
    assert two.eval_losses[3] == pytest.approx(one.eval_losses[3], rel=1e-5)
    # the gradients agree to rounding; the weights by the Adam bound of those gradients: where an
    # element's gradient is noise-level (~eps, seen on an AVX-512 host: one expert weight of 32768
    # had a step-2 gradient of -3.1e-8 against -3.2e-8), Adam makes the rounding up to lr of a step
    print(assert_same_steps(
        (tmp_path / "workers1", one.hf_model_dir), (tmp_path / "workers2", two.hf_model_dir), config.engine, 3
    ))  # fmt: skip


def test_the_batch_must_divide_over_the_workers():
    with pytest.raises(
        ValueError, match=r"trainer.global_batch_size=5 must divide evenly over the 2 workers"
    ):
        SFTTrainerConfig(global_batch_size=5, n_workers=2)
    with pytest.raises(ValueError, match="trainer.n_workers"):
        SFTTrainerConfig(n_gpus_per_node=2, n_workers=3, global_batch_size=6)
