"""End-to-end RL runs on CPU: parameters move, metrics are finite, resume and reruns are exact,
a crash while checkpointing leaves a usable checkpoint, bad rewards never stop a run, every preset runs."""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tandem.data.rows import read_rows
from tandem.models import load_model
from tandem.rl import RLTrainer
from tandem.run.checkpoints import CheckpointManager
from tandem.run.trackers import read_jsonl
from tests.rl.conftest import small_config

CORE_METRICS = [
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "critic/score/mean",
    "response_length/mean",
    "rollout_corr/kl",
    "rollout_corr/max_abs_log_prob_diff",
    "rollout_corr/ratio_mean",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/ref",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    "perf/throughput",
]


def _without_timings(history):
    return [
        {k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/throughput"))} for h in history
    ]


def test_grpo_run_updates_the_policy_and_logs_finite_metrics(rl_files, tmp_path):
    config = small_config(rl_files, tmp_path, "trainer.export_hf=true", "trainer.loggers=[jsonl,tensorboard]")
    result = RLTrainer(config).fit()
    steps = [h for h in result.history if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2]
    for metrics in steps:
        for name in CORE_METRICS:
            assert math.isfinite(metrics[name]), name
        assert metrics["rollout_corr/max_abs_log_prob_diff"] < 1e-4  # rollout and trainer agree
    assert "val-core/arithmetic/acc/mean@1" in result.validation
    before, after = load_model(rl_files["model"]), load_model(result.hf_model_dir)
    changed = [
        n for n, p in after.named_parameters() if not torch.equal(p, dict(before.named_parameters())[n])
    ]
    assert len(changed) == len(list(before.parameters()))
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    page = result.report.read_text()
    assert "Plotly.newPlot" in page
    samples = read_jsonl(tmp_path / "val_samples.jsonl")  # the first validation prompts, every validation
    validated = sorted({r["step"] for r in records if "val-core/arithmetic/acc/mean@1" in r})
    val_rows = read_rows(rl_files["val"])[:4]
    assert [s["step"] for s in samples] == [step for step in validated for _ in val_rows]
    assert [s["ground_truth"] for s in samples[:4]] == [r["reward_model"]["ground_truth"] for r in val_rows]
    assert all(r["prompt"][-1]["content"] in s["prompt"] for s, r in zip(samples[:4], val_rows, strict=True))
    assert "Validation samples" in page and "validation at step 0" in page
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "checkpoints" / "latest").read_text() == "global_step_2"


def test_resume_reproduces_the_uninterrupted_run_and_reruns_are_identical(rl_files, tmp_path):
    full = RLTrainer(
        small_config(rl_files, tmp_path / "full", "trainer.total_steps=4", "trainer.val_every=2")
    ).fit()
    part = small_config(rl_files, tmp_path / "part", "trainer.total_steps=2", "trainer.val_every=2")
    first = RLTrainer(part).fit()
    assert _without_timings(first.history) == _without_timings(full.history[:3])  # same seed, same run
    resumed = RLTrainer(
        small_config(rl_files, tmp_path / "part", "trainer.total_steps=4", "trainer.val_every=2")
    ).fit()
    assert [h["step"] for h in resumed.history] == [3, 4]
    assert _without_timings(resumed.history) == _without_timings(full.history[3:])
    assert [r["step"] for r in read_jsonl(tmp_path / "part" / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    run = json.loads((tmp_path / "part" / "run.json").read_text())  # the first start kept, the resume added
    assert run["started_at"] <= run["resumed_at"][0]["time"] and run["resumed_at"][0]["step"] == 2
    assert json.loads((tmp_path / "part" / "status.json").read_text())["status"] == "finished"


KILL_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {root!r})
from tandem.rl import RLTrainer
from tandem.run.checkpoints import CheckpointManager
from tests.rl.conftest import small_config

files = {files!r}
original = CheckpointManager.save

def crash_in_step_4(self, step, state, save_actor):
    if step < 4:
        return original(self, step, state, save_actor)
    def save_then_die(path):
        save_actor(path)  # the engine state is on disk, the checkpoint is not finished
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, step, state, save_then_die)

CheckpointManager.save = crash_in_step_4
RLTrainer(small_config(files, {out!r}, "trainer.total_steps=4", "trainer.save_every=2", "trainer.val_before_train=false")).fit()
"""


def test_a_kill_during_checkpoint_write_leaves_a_resumable_checkpoint(rl_files, tmp_path):
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    script = KILL_SCRIPT.format(root=root, files=rl_files, out=str(tmp_path))
    process = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True)
    assert process.returncode == -9, process.stderr[-2000:]
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=2)
    assert (tmp_path / "checkpoints" / "global_step_4.tmp").exists()
    assert [p.name for p in manager.complete()] == ["global_step_2"]
    resumed = RLTrainer(
        small_config(rl_files, tmp_path, "trainer.total_steps=4", "trainer.save_every=2")
    ).fit()
    assert [h["step"] for h in resumed.history] == [3, 4]
    assert [p.name for p in manager.complete()] == ["global_step_2", "global_step_4"]
    assert not (tmp_path / "checkpoints" / "global_step_4.tmp").exists()


@pytest.mark.slow  # two RL runs; the fast sibling is tests/run/test_checkpoints.py
def test_a_truncated_shard_is_refused_by_path_and_skipped_by_auto_resume(rl_files, tmp_path):
    settings = ("trainer.total_steps=4", "trainer.save_every=2", "data.val_path=")
    first = RLTrainer(small_config(rl_files, tmp_path, *settings)).fit()
    damaged = tmp_path / "checkpoints" / "global_step_4"
    shard = sorted((damaged / "actor").rglob("*.distcp"))[0]
    os.truncate(shard, shard.stat().st_size - 1)
    with pytest.raises(ValueError, match=f"cannot resume from checkpoint {damaged}: {shard} holds"):
        RLTrainer(small_config(rl_files, tmp_path, *settings, f"trainer.resume={damaged}")).fit()
    resumed = RLTrainer(small_config(rl_files, tmp_path, *settings)).fit()
    assert [h["step"] for h in resumed.history] == [3, 4]
    assert _without_timings(resumed.history) == _without_timings(first.history[2:])


def test_keep_last_prunes_old_checkpoints(rl_files, tmp_path):
    RLTrainer(small_config(rl_files, tmp_path, "trainer.total_steps=3", "trainer.save_every=1", "trainer.keep_last=2",
                           "data.val_path=")).fit()  # fmt: skip
    names = [p.name for p in CheckpointManager(tmp_path / "checkpoints", 2).complete()]
    assert names == ["global_step_2", "global_step_3"]
    state = json.loads((tmp_path / "checkpoints" / "global_step_3" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["sampler"]["cursor"] == 12


def test_a_raising_and_a_hanging_reward_function_are_counted_and_the_run_goes_on(rl_files, tmp_path):
    reward = tmp_path / "flaky.py"
    reward.write_text(
        "import time\n"
        "calls = [0]\n"
        "def compute_score(data_source, solution, ground_truth, extra_info):\n"
        "    calls[0] += 1\n"
        "    if calls[0] % 5 == 0:\n"
        "        raise RuntimeError('flaky scorer')\n"
        "    if calls[0] == 3:\n"
        "        time.sleep(30)\n"
        "    return float(solution.strip() == ground_truth)\n"
    )
    result = RLTrainer(
        small_config(
            rl_files, tmp_path, f"reward.custom_path={reward}", "reward.timeout_s=1", "data.val_path="
        )
    ).fit()
    step1, step2 = result.history
    assert step1["reward/timeouts"] == 1 and step1["reward/errors"] >= 3
    assert step2["reward/errors"] >= 3 and math.isfinite(step2["actor/pg_loss"])


@pytest.mark.parametrize(
    "preset", ["dapo", "gspo", "cispo", "sapo", "rloo", "reinforce_pp", "remax", "dr_grpo"]
)
def test_every_preset_trains(rl_files, tmp_path, preset):
    overrides = [f"preset={preset}", "trainer.total_steps=1", "data.val_path=", "actor.ppo_mini_batch_size=2"]
    result = RLTrainer(small_config(rl_files, tmp_path, *overrides)).fit()
    (metrics,) = result.history
    assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"])
    if preset == "dapo":
        assert metrics["dynamic_sampling/gen_rounds"] >= 1
    if preset == "reinforce_pp":
        assert "actor/reward_kl" in metrics


def history_without_validation(rl_files, path, *overrides) -> list[dict]:
    """Per-step metrics of a short run with no validation set."""
    return RLTrainer(small_config(rl_files, path, "data.val_path=", *overrides)).fit().history


def test_old_log_probs_from_the_update_equal_a_separate_forward(rl_files, tmp_path):
    fused = history_without_validation(rl_files, tmp_path / "fused")
    separate = history_without_validation(
        rl_files, tmp_path / "separate", "actor.recompute_old_log_probs=true"
    )
    for a, b in zip(fused, separate, strict=True):
        assert "timing_s/old_log_prob" in b and "timing_s/old_log_prob" not in a
        for name in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "rollout_corr/kl",
                     "rollout_corr/ratio_mean", "rollout_corr/max_abs_log_prob_diff"):  # fmt: skip
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), name


def test_freeing_the_kv_cache_between_generations_changes_nothing(rl_files, tmp_path):
    kept = history_without_validation(rl_files, tmp_path / "kept")
    freed = history_without_validation(
        rl_files, tmp_path / "freed", "rollout.free_cache_between_generations=true"
    )
    assert _without_timings(kept) == _without_timings(freed)


def test_the_hf_reference_engine_runs_the_loop_and_agrees_with_native_and_the_trainer(rl_files, tmp_path):
    """The same loop with transformers' ``generate`` as the rollout engine: greedy validation
    answers equal the native engine's, and its log-probs match the trainer's."""
    one_step = ("trainer.total_steps=1", "trainer.device=cpu")
    hf = RLTrainer(small_config(rl_files, tmp_path / "hf", "rollout.engine.name=hf", *one_step)).fit()
    native = RLTrainer(small_config(rl_files, tmp_path / "native", *one_step)).fit()
    assert hf.history[0]["step"] == 0 and hf.history[0] == native.history[0]  # validation before training
    (step,) = [h for h in hf.history if h["step"] == 1]
    assert step["rollout_corr/max_abs_log_prob_diff"] < 1e-4
    assert math.isfinite(step["actor/pg_loss"]) and step["response_length/mean"] > 0


def test_the_schedule_steps_once_per_rl_step_when_asked(rl_files, tmp_path):
    """``trainer.lr_schedule_unit=step`` (verl's): every mini-batch of a step uses the same rate, and
    the warmup counts RL steps; by default it counts optimizer steps."""
    common = ("data.val_path=", "actor.ppo_mini_batch_size=2", "trainer.total_steps=3", "actor.engine.lr=1e-3",
              "actor.engine.warmup_steps=2", "actor.engine.warmup_from_zero=true")  # fmt: skip
    per_step = history_without_validation(
        rl_files, tmp_path / "step", *common, "trainer.lr_schedule_unit=step"
    )
    assert [h["actor/lr"] for h in per_step] == pytest.approx([0.0, 5e-4, 1e-3])
    per_update = history_without_validation(rl_files, tmp_path / "update", *common)
    assert [h["actor/lr"] for h in per_update] == pytest.approx(
        [2.5e-4, 1e-3, 1e-3]
    )  # (0 + 0.5) / 2, then full
