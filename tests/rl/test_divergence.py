"""A diverging RL run stops at the step where it diverged, saves nothing from it, and resumes
from the last good checkpoint as if nothing had happened; single non-finite updates are
skipped and counted."""

import math

import pytest

import tandem.rl.worker as worker_module
from tandem.engine.divergence import DivergenceError
from tandem.rl import RLTrainer
from tandem.run.checkpoints import CheckpointManager
from tandem.run.trackers import read_jsonl
from tests.rl.conftest import small_config

NO_VAL = ("data.val_path=", "trainer.save_every=1")


def _comparable(history):
    return [{k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/"))} for h in history]


def test_lr_1e30_stops_at_the_step_saves_nothing_from_it_and_resume_matches_the_clean_run(rl_files, tmp_path):
    clean = RLTrainer(small_config(rl_files, tmp_path / "clean", *NO_VAL, "trainer.total_steps=3")).fit()

    run = tmp_path / "run"
    RLTrainer(small_config(rl_files, run, *NO_VAL, "trainer.total_steps=1", "trainer.export_hf=true")).fit()
    exported = sorted(p.name for p in (run / "hf_model").iterdir())
    diverging = RLTrainer(
        small_config(rl_files, run, *NO_VAL, "trainer.total_steps=3", "actor.engine.lr=1e30")
    )
    with pytest.raises(DivergenceError, match=r"step 2: .*log-probs are not finite.*global_step_1"):
        diverging.fit()
    checkpoints = CheckpointManager(run / "checkpoints", keep_last=2)
    assert [p.name for p in checkpoints.complete()] == ["global_step_1"]  # step 2 was never saved
    assert sorted(p.name for p in (run / "hf_model").iterdir()) == exported  # nor exported over the old model
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]

    resumed = RLTrainer(small_config(rl_files, run, *NO_VAL, "trainer.total_steps=3")).fit()
    assert _comparable(resumed.history) == _comparable(clean.history[1:])
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]


def _nan_loss_on_updates(monkeypatch, updates: set[int]) -> None:
    """Make the actor's loss NaN on the given updates (1-based; one update per step here)."""
    real, calls = worker_module.make_actor_loss, [0]

    def make(*args, **kwargs):
        calls[0] += 1
        loss_fn, poisoned = real(*args, **kwargs), calls[0] in updates

        def loss(micro, outputs):
            value, metrics = loss_fn(micro, outputs)
            return (value * math.nan if poisoned else value), metrics

        return loss

    monkeypatch.setattr(worker_module, "make_actor_loss", make)


def test_a_nan_update_is_skipped_and_counted_and_too_many_in_a_row_stop_the_run(
    rl_files, tmp_path, monkeypatch
):
    overrides = (*NO_VAL, "trainer.total_steps=4", "trainer.max_skipped_updates_in_a_row=2")
    _nan_loss_on_updates(monkeypatch, {2})
    history = RLTrainer(small_config(rl_files, tmp_path / "one", *overrides)).fit().history
    assert [h["actor/skipped_updates"] for h in history] == [0, 1, 0, 0]
    assert [h["actor/skipped_updates_in_a_row"] for h in history] == [0, 1, 0, 0]
    weights = [h["actor/max_abs_weight"] for h in history]
    assert weights[1] == weights[0] and weights[2] != weights[1]  # the skipped update left the weights alone

    _nan_loss_on_updates(monkeypatch, {2, 3, 4})
    with pytest.raises(
        DivergenceError, match=r"step 3: 2 optimizer steps in a row .*max_skipped_updates_in_a_row=2"
    ):
        RLTrainer(small_config(rl_files, tmp_path / "many", *overrides)).fit()
    assert [p.name for p in CheckpointManager(tmp_path / "many" / "checkpoints", 9).complete()] == [
        "global_step_1",
        "global_step_2",
    ]
