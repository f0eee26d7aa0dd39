"""The asynchronous pipelines end to end on CPU: staleness bounds, token versions, kills, resume."""

import dataclasses
import math
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from tandem.controller.group import WorkerGroup
from tandem.errors import RolloutReplicaError
from tandem.pipeline import runner
from tandem.pipeline.sample_store import PREFIX as SAMPLE_PREFIX
from tandem.protocol.shared import PROBE_PREFIX
from tandem.rl import RLTrainer
from tandem.rl.derived import replica_plan
from tests.pipeline.replicas import DelayedReplica, DyingReplica
from tests.rl.conftest import assert_same_histories, small_config

TWO_CORES = ("pipeline.trainer_threads=1", "pipeline.rollout_threads=1")


class RecordingTrainer(RLTrainer):
    """Keeps each trained batch's per-token weight versions and response mask (and the last batch)."""

    def compute_advantages(self, batch):
        self.trained = getattr(self, "trained", [])
        self.trained.append(
            (self.step, batch["weight_version"].clone(), batch["response_mask"].bool().clone())
        )
        self.last_batch = batch
        return super().compute_advantages(batch)


BATCH_PATH = "dataplane.enabled=false"  # the per-token weight versions reach the controller


def _train(rl_files, tmp_path, *overrides):
    """A recorded run of ``small_config`` with the overrides, each side on one thread, on the
    ``Batch`` path: the recorder reads every token's ``weight_version`` on the controller (with
    the data plane those stay in the replicas' blocks, and its runs' metrics, the logged
    staleness included, equal this path's: tests/pipeline/test_async_dataplane.py)."""
    trainer = RecordingTrainer(small_config(rl_files, tmp_path, BATCH_PATH, *overrides, *TWO_CORES))
    return trainer, trainer.fit()


def _token_staleness(trained):
    """Per step: (lowest, highest) staleness over the trained tokens."""
    out = {}
    for step, versions, mask in trained:
        lag = (step - 1) - versions[mask]
        out[step] = (int(lag.min()), int(lag.max()))
    return out


def test_fully_async_never_trains_a_token_older_than_the_threshold(rl_files, tmp_path, monkeypatch):
    monkeypatch.setattr(runner.AsyncRollout, "replica_class", DelayedReplica)  # out-of-order, late groups
    trainer, result = _train(
        rl_files, tmp_path, "pipeline.mode=fully_async", "pipeline.staleness_threshold=1",
        "pipeline.rollout_replicas=2", "trainer.total_steps=8",
    )  # fmt: skip
    assert [s for s, _, _ in trainer.trained] == list(range(1, 9))
    for step, versions, mask in trainer.trained:
        assert versions.shape == mask.shape  # every response token has its version recorded
        assert (versions[mask] >= 0).all() and (versions[mask] <= step - 1).all()
    lags = _token_staleness(trainer.trained)
    assert all(low >= 0 and high <= 1 for low, high in lags.values()), lags
    logged = [h for h in result.history if "pipeline/staleness/max" in h]
    assert len(logged) == 8 and max(h["pipeline/staleness/max"] for h in logged) <= 1
    for name in ("pipeline/queue_depth", "pipeline/trainer_idle_s", "pipeline/rollout_idle_s",
                 "pipeline/dropped_stale", "pipeline/weight_sync_s", "pipeline/weight_sync_gbps"):  # fmt: skip
        assert name in logged[-1], name
    assert not multiprocessing.active_children()  # the replicas are gone


def test_old_log_probs_can_come_from_the_rollout(rl_files, tmp_path):
    trainer, result = _train(
        rl_files, tmp_path, "pipeline.mode=fully_async", "pipeline.old_log_probs=rollout",
        "data.val_path=", "trainer.total_steps=3",
    )  # fmt: skip
    batch = trainer.last_batch
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])  # the behaviour policy's own
    assert not any("timing_s/old_log_prob" in h for h in result.history)  # no recompute forward
    assert all(math.isfinite(h["actor/pg_loss"]) for h in result.history)


def test_two_fsdp2_trainer_ranks_feed_a_replica(rl_files, tmp_path):
    trainer, result = _train(
        rl_files, tmp_path, "pipeline.mode=fully_async", "trainer.n_workers=2", "actor.engine.strategy=fsdp2",
        "data.val_path=", "trainer.total_steps=3",
    )  # fmt: skip
    assert [h["step"] for h in result.history] == [1, 2, 3]
    assert all(high <= 1 for _, high in _token_staleness(trainer.trained).values())
    assert all(h["pipeline/weight_sync_gbps"] > 0 for h in result.history)  # rank 0 gathered and sent
    assert not multiprocessing.active_children()


def test_hf_engine_replicas(rl_files, tmp_path):
    """The HF reference engine on the replicas (vLLM's are in test_vllm_replicas.py, slow tier)."""
    trainer, result = _train(
        rl_files, tmp_path, "pipeline.mode=fully_async", "rollout.engine.name=hf", "data.val_path=",
        "trainer.total_steps=3",
    )  # fmt: skip
    assert [h["step"] for h in result.history] == [1, 2, 3]
    assert all(high <= 1 for _, high in _token_staleness(trainer.trained).values())
    assert result.history[0]["rollout_corr/max_abs_log_prob_diff"] < 1e-4  # staleness 0: same weights


def test_fully_async_on_ray_actors(rl_files, tmp_path, ray_cluster):
    trainer, result = _train(
        rl_files, tmp_path, "pipeline.mode=fully_async", "trainer.backend=ray", "data.val_path=",
        "trainer.total_steps=3",
    )  # fmt: skip
    assert [h["step"] for h in result.history] == [1, 2, 3]
    assert all(high <= 1 for _, high in _token_staleness(trainer.trained).values())
    assert all(h["pipeline/weight_sync_gbps"] > 0 for h in result.history)


def test_one_step_off_trains_batch_k_on_weights_k_minus_2(rl_files, tmp_path):
    trainer, result = _train(
        rl_files, tmp_path, "pipeline.mode=one_step_off", "trainer.total_steps=5",
        "trainer.val_before_train=false", "data.val_path=",
    )  # fmt: skip
    lags = _token_staleness(trainer.trained)
    assert lags == {1: (0, 0), 2: (1, 1), 3: (1, 1), 4: (1, 1), 5: (1, 1)}


def test_replicas_that_cannot_share_files_send_samples_inline(rl_files, tmp_path, monkeypatch):
    """As if the replica ran on another host: ``auto`` finds it blind to our /dev/shm and the
    samples travel with their metadata; ``shared_memory`` refuses, naming the replica."""
    seeing = WorkerGroup.ranks_seeing

    def blind_to_shm(group, directory):
        return set() if directory == "/dev/shm" else seeing(group, directory)

    monkeypatch.setattr(WorkerGroup, "ranks_seeing", blind_to_shm)
    before = {name for name in os.listdir("/dev/shm") if name.startswith(SAMPLE_PREFIX)}
    trainer, result = _train(
        rl_files, tmp_path, "pipeline.mode=one_step_off", "trainer.total_steps=3", "data.val_path=",
    )  # fmt: skip
    assert [h["step"] for h in result.history] == [1, 2, 3]
    assert _token_staleness(trainer.trained) == {1: (0, 0), 2: (1, 1), 3: (1, 1)}
    after = {name for name in os.listdir("/dev/shm") if name.startswith(SAMPLE_PREFIX)}
    assert after == before
    with pytest.raises(ValueError, match="sample_store=shared_memory, but rollout replica 0 cannot read"):
        _train(
            rl_files, tmp_path / "again", "pipeline.mode=one_step_off", "pipeline.sample_store=shared_memory"
        )
    assert not multiprocessing.active_children()


def test_weights_through_files_are_refused_for_replicas_that_cannot_read_the_senders(
    rl_files, tmp_path, monkeypatch
):
    """As if the replicas ran on another machine than trainer rank 0 (blind to its /dev/shm):
    the file-based weight backends cannot reach them, which is said before the first sync,
    naming the key."""
    reading = WorkerGroup.ranks_reading

    def blind_to_shm(group, path, token):
        return set() if path.startswith("/dev/shm/") else reading(group, path, token)

    monkeypatch.setattr(WorkerGroup, "ranks_reading", blind_to_shm)
    probes = {name for name in os.listdir("/dev/shm") if name.startswith(PROBE_PREFIX)}
    with pytest.raises(
        ValueError, match="checkpoint_engine.backend=shared_memory: rollout replica 0 cannot read"
    ):
        _train(rl_files, tmp_path, "pipeline.mode=one_step_off", "pipeline.sample_store=inline")
    assert {name for name in os.listdir("/dev/shm") if name.startswith(PROBE_PREFIX)} == probes
    assert not multiprocessing.active_children()


def test_inline_samples_train_like_shared_memory(rl_files, tmp_path):
    """one_step_off is deterministic: the same run with each sample store logs the same numbers."""
    runs = {}
    for store in ("shared_memory", "inline"):
        _, result = _train(
            rl_files, tmp_path / store, "pipeline.mode=one_step_off", f"pipeline.sample_store={store}",
            "trainer.total_steps=3", "data.val_path=",
        )  # fmt: skip
        runs[store] = result.history
    for a, b in zip(runs["shared_memory"], runs["inline"], strict=True):
        for name in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm"):
            assert a[name] == pytest.approx(b[name], rel=1e-6, abs=1e-7), name


@pytest.mark.slow  # two pipeline runs (the fast siblings: test_sample_queue.py, test_groups.py)
def test_a_byte_bound_on_waiting_samples_holds_and_changes_timing_not_data(rl_files, tmp_path):
    """one_step_off is deterministic: with room for about one of a step's four groups (each
    256..576 bytes) the queue never holds more than the bound, the replica's finished groups wait
    while the trainer trains, and the run logs the same numbers as an unbounded one."""
    bound = 600
    runs = {}
    for name, setting in (("unbounded", 0), ("bounded", bound)):
        _, result = _train(
            rl_files, tmp_path / name, "pipeline.mode=one_step_off", f"pipeline.max_inflight_bytes={setting}",
            "trainer.total_steps=3", "data.val_path=",
        )  # fmt: skip
        runs[name] = result.history
    bounded = runs["bounded"]
    assert max(h["pipeline/inflight_bytes_max"] for h in bounded) <= bound
    assert max(h["pipeline/inflight_bytes_max"] for h in runs["unbounded"]) > bound  # it did bind
    assert sum(h["pipeline/rollout_wait_s"] for h in bounded) > 0  # the rollout waited, dropping nothing
    without_bytes = [{k: v for k, v in h.items() if not k.startswith("pipeline/inflight")} for h in bounded]
    assert_same_histories(
        [{k: v for k, v in h.items() if not k.startswith("pipeline/inflight")} for h in runs["unbounded"]],
        without_bytes,
    )
    assert not multiprocessing.active_children()


def _shared_memory_files(pids):
    """The weight-slot and sample files of processes ``pids`` still in /dev/shm."""
    return [name for name in os.listdir("/dev/shm") if any(f"-{pid}-" in name for pid in pids)]


def _run_in_thread(trainer):
    outcome = {}

    def run():
        try:
            outcome["result"] = trainer.fit()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def _assert_stopped_naming_replica_0(thread, outcome):
    thread.join(timeout=60)
    assert not thread.is_alive(), "the run did not stop after its replica died"
    error = outcome["error"]
    assert isinstance(error, RolloutReplicaError) and "rollout replica 0" in str(error), error
    assert not multiprocessing.active_children()


def _async_config(rl_files, tmp_path):
    return small_config(
        rl_files, tmp_path, "pipeline.mode=fully_async", "trainer.total_steps=10000",
        "trainer.val_before_train=false", "data.val_path=", *TWO_CORES,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_killed_replica_stops_the_run_naming_it(rl_files, tmp_path, request, backend):
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    config = _async_config(rl_files, tmp_path)
    trainer = RLTrainer(
        dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, backend=backend))
    )
    thread, outcome = _run_in_thread(trainer)
    deadline = time.monotonic() + 120
    while trainer.step < 2 and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.05)
    assert trainer.step >= 2, outcome
    pid = trainer.rollout.replicas.backend.host_pids[0]
    trainer_pids = trainer.workers.backend.host_pids
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    _assert_stopped_naming_replica_0(thread, outcome)
    assert time.monotonic() - killed < 30
    # weight slots and stored samples are deleted (Ray kills its actors, which clean up nothing)
    assert not _shared_memory_files([os.getpid(), pid, *trainer_pids])


def test_a_replica_lost_during_a_weight_sync_stops_the_run_naming_it(rl_files, tmp_path, monkeypatch):
    monkeypatch.setattr(runner.AsyncRollout, "replica_class", DyingReplica)  # dies as version 2 arrives
    thread, outcome = _run_in_thread(RLTrainer(_async_config(rl_files, tmp_path)))
    _assert_stopped_naming_replica_0(thread, outcome)  # not after the sync's 300 s timeout
    assert "weight version 2" in str(outcome["error"])
    assert not _shared_memory_files([os.getpid()])


def test_an_async_run_resumes_from_its_checkpoint(rl_files, tmp_path):
    overrides = ("pipeline.mode=fully_async", "trainer.save_every=1", "data.val_path=", BATCH_PATH, *TWO_CORES)  # fmt: skip
    first = RLTrainer(small_config(rl_files, tmp_path, "trainer.total_steps=2", *overrides)).fit()
    assert [h["step"] for h in first.history] == [1, 2]
    resumed = RecordingTrainer(small_config(rl_files, tmp_path, "trainer.total_steps=4", *overrides))
    result = resumed.fit()
    assert [h["step"] for h in result.history] == [3, 4]
    # the replicas start from the checkpoint's weights (version 2): step 3 trains fresh samples
    assert _token_staleness(resumed.trained)[3] == (0, 0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["pipeline.checkpoint_engine.backend=naive"], "pipeline.checkpoint_engine.backend"),
        (
            ["pipeline.trigger_parameter_sync_step=3", "pipeline.staleness_threshold=1"],
            "staleness_threshold=1",
        ),
        (["pipeline.mode=sometimes"], "pipeline.mode"),
        (["pipeline.max_inflight_bytes=-1"], r"pipeline.max_inflight_bytes=-1 is outside"),
        (["pipeline.max_inflight_bytes=1.5"], "pipeline.max_inflight_bytes"),
        (["pipeline.old_log_probs=rollout", "rollout.top_p=0.9"], "rollout.top_p=1"),
    ],
)
def test_unsupported_pipeline_settings_are_named(rl_files, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(rl_files, tmp_path, "pipeline.mode=fully_async", *overrides)


def test_local_replicas_take_the_gpus_after_the_trainers(rl_files, tmp_path):
    """With spawned processes the trainer holds GPUs 0..W-1 and replica 0 binds GPU W (on the CPU
    the index changes nothing); Ray assigns each replica a GPU of its own."""
    shape = ("pipeline.mode=one_step_off", "trainer.n_workers=2", "pipeline.rollout_replicas=2")
    assert replica_plan(small_config(rl_files, tmp_path, *shape)).first_gpu == 2
    assert replica_plan(small_config(rl_files, tmp_path, *shape, "trainer.backend=ray")).first_gpu == 0


def test_a_tensor_parallel_vllm_replica_reserves_its_gpus(rl_files, tmp_path):
    """Each replica's pool slot holds its engine's GPUs; sync mode, whose engines live in the
    trainer's one-GPU workers, refuses a tensor-parallel engine naming both keys."""
    tp = ("rollout.engine.name=vllm", "rollout.engine.vllm.tensor_parallel_size=2")
    config = small_config(
        rl_files, tmp_path, "pipeline.mode=one_step_off", "pipeline.rollout_replicas=2", *tp
    )
    assert config.rollout.engine.gpus_per_engine == 2
    on_gpus = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, n_gpus_per_node=1))
    assert on_gpus.rollout_resource_pool().gpus_per_process == 2
    assert config.rollout_resource_pool().gpus_per_process == 0  # CPU workers reserve none
    with pytest.raises(ValueError, match=r"rollout.engine.vllm.tensor_parallel_size=2 .*pipeline.mode=sync"):
        small_config(rl_files, tmp_path, *tp)
