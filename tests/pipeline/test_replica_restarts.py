"""``pipeline.replica_restarts``: a lost rollout replica is replaced and the run finishes.

Each run has one replica, so no step after the loss could be trained unless the new replica
received the weights and generated the lost prompt groups again.
"""

import multiprocessing
import os
import signal
import time

import pytest

from tandem.dataplane import BatchRef
from tandem.errors import RolloutReplicaError
from tandem.pipeline import runner
from tandem.rl import RLTrainer
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
        "data.val_path=", "pipeline.rollout_replicas=1", *TWO_CORES,
        "dataplane.enabled=false", *overrides,  # RecordingTrainer reads per-token versions; on: the slow test below
    )  # fmt: skip



def _run_killing_the_first_replica(trainer):
    """Run ``trainer``, SIGKILL its first replica's host process once two steps have trained, and
    finish the run; returns the result and the killed pid."""
    thread, outcome = _run_in_thread(trainer)
    deadline = time.monotonic() + 120
    while trainer.step < 2 and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.05)
    assert trainer.step >= 2, outcome
    killed = trainer.rollout.replicas.backend.host_pids[0]
    os.kill(killed, signal.SIGKILL)
    return _finish(thread, outcome, trainer), killed

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
    result, killed = _run_killing_the_first_replica(trainer)
    assert _restarts(result) == 1
    lags = _token_staleness(trainer.trained)
    assert all(low >= 0 and high <= 1 for low, high in lags.values()), lags
    assert not _shared_memory_files([killed])  # the lost replica's stored samples are deleted
    # provenance: the last step (>= 2 steps after the loss) trains only on the new process's rows
    assert set(trainer.last_batch["replica_generation"]) == {1}, trainer.last_batch["replica_generation"]


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


class StoredDrawTrainer(RLTrainer):
    """Records each trained step, whether its draw came as references, and the replicas' processes."""

    def train_step(self):
        self.replica_pids = getattr(self, "replica_pids", set()) | set(self.rollout.host_pids())
        return super().train_step()

    def _policy_gradient_update(self, batch, timings):
        self.trained = [*getattr(self, "trained", []), (self.step, isinstance(batch, BatchRef), None)]
        return super()._policy_gradient_update(batch, timings)


@pytest.mark.slow  # the local sibling above is the fast tier's; this one keeps the samples in blocks
def test_a_killed_replica_with_its_samples_in_the_data_plane_leaves_no_block(rl_files, tmp_path):
    """``dataplane.enabled``: the lost replica's blocks (groups it had reported, trained or not) and
    the new replica's are all gone when the run ends, and every step trained a stored draw."""
    trainer = StoredDrawTrainer(
        _config(
            rl_files, tmp_path, "pipeline.mode=fully_async", "pipeline.staleness_threshold=1",
            "pipeline.replica_restarts=1", "dataplane.enabled=true",
        )
    )  # fmt: skip
    result, killed = _run_killing_the_first_replica(trainer)
    assert _restarts(result) == 1
    assert all(stored for _, stored, _ in trainer.trained)
    assert max(h["pipeline/staleness/max"] for h in result.history) <= 1
    assert killed in trainer.replica_pids and len(trainer.replica_pids) == 2  # the lost one and its successor
    assert not _shared_memory_files([*trainer.replica_pids, os.getpid()])
