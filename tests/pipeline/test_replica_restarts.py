"""``pipeline.replica_restarts``: a lost rollout replica is replaced and the run finishes.

Each run has one replica, so no step after the loss could be trained unless the new replica
received the weights and generated the lost prompt groups again.
"""

import multiprocessing
import os
import signal
import time

import pytest

from tandem.errors import RolloutReplicaError
from tandem.pipeline import runner
from tests.pipeline.replicas import DyingOnceReplica, DyingReplica
from tests.pipeline.test_async_training import (
    TWO_CORES,
    RecordingTrainer,
    _run_in_thread,
    _shared_memory_files,
    _token_staleness,
)
from tests.rl.conftest import small_config

STEPS = 6


def _config(rl_files, tmp_path, *overrides):
    return small_config(
        rl_files, tmp_path, f"trainer.total_steps={STEPS}", "trainer.val_before_train=false",
        "data.val_path=", "pipeline.rollout_replicas=1", *TWO_CORES, *overrides,
    )  # fmt: skip


def _finish(thread, outcome, trainer, timeout_s=240):
    thread.join(timeout=timeout_s)
    assert not thread.is_alive(), "the run did not finish"
    assert "error" not in outcome, outcome.get("error")
    assert [s for s, _, _ in trainer.trained] == list(range(1, STEPS + 1))
    assert not multiprocessing.active_children()
    return outcome["result"]


def _restarts(result):
    return sum(h.get("pipeline/replica_restarts", 0.0) for h in result.history)


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.slow)])
def test_a_killed_replica_is_restarted_and_the_run_finishes(rl_files, tmp_path, request, backend):
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    trainer = RecordingTrainer(
        _config(
            rl_files, tmp_path, "pipeline.mode=fully_async", "pipeline.staleness_threshold=1",
            "pipeline.replica_restarts=1", f"trainer.backend={backend}",
        )
    )  # fmt: skip
    thread, outcome = _run_in_thread(trainer)
    deadline = time.monotonic() + 120
    while trainer.step < 2 and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.05)
    assert trainer.step >= 2, outcome
    killed = trainer.rollout.replicas.backend.host_pids[0]
    os.kill(killed, signal.SIGKILL)
    result = _finish(thread, outcome, trainer)
    assert _restarts(result) == 1
    lags = _token_staleness(trainer.trained)
    assert all(low >= 0 and high <= 1 for low, high in lags.values()), lags
    assert not _shared_memory_files([killed])  # the lost replica's stored samples are deleted


def test_a_replica_lost_during_a_weight_sync_is_restarted(rl_files, tmp_path, monkeypatch):
    marker = tmp_path / "die-once"
    marker.write_text("")
    monkeypatch.setenv("DIE_ONCE_FILE", str(marker))
    monkeypatch.setattr(runner.AsyncRollout, "replica_class", DyingOnceReplica)
    trainer = RecordingTrainer(
        _config(rl_files, tmp_path, "pipeline.mode=one_step_off", "pipeline.replica_restarts=2")
    )
    thread, outcome = _run_in_thread(trainer)
    result = _finish(thread, outcome, trainer)
    assert not marker.exists()  # the replica did die
    assert _restarts(result) == 1
    lags = _token_staleness(trainer.trained)
    assert all(low >= 0 and high <= 1 for low, high in lags.values()), lags


def test_a_replica_that_keeps_dying_ends_the_run_when_the_restarts_are_spent(
    rl_files, tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(runner.AsyncRollout, "replica_class", DyingReplica)  # dies at every version from 2 on
    trainer = RecordingTrainer(
        _config(rl_files, tmp_path, "pipeline.mode=fully_async", "pipeline.replica_restarts=1")
    )
    thread, outcome = _run_in_thread(trainer)
    thread.join(timeout=180)
    assert not thread.is_alive()
    error = outcome.get("error")
    assert isinstance(error, RolloutReplicaError) and "rollout replica 0" in str(error), error
    restarts = [r for r in caplog.records if r.getMessage().endswith("restarting it")]
    assert len(restarts) == 1, "one restart, then the error"
    assert not multiprocessing.active_children()
    assert not _shared_memory_files([os.getpid()])


def test_replica_restarts_must_not_be_negative(rl_files, tmp_path):
    with pytest.raises(ValueError, match="pipeline.replica_restarts"):
        _config(rl_files, tmp_path, "pipeline.mode=fully_async", "pipeline.replica_restarts=-1")
