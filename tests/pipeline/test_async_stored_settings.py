"""Two asynchronous settings that used to send the draws through the controller keep them in the
rollout replica's blocks with ``dataplane.enabled``: ``pipeline.old_log_probs=rollout`` (the stored
``rollout_log_probs`` get a second name, ``BatchRef.alias``) and ``pipeline.sample_store=inline``
(the replica's blocks replace the sample store). A one-step-off run with the data plane on trains
like the same run with it off, step for step; the fast checks of what a replica is told are here
too."""

import multiprocessing
import os
from types import SimpleNamespace

import pytest

from tandem.dataplane import BatchRef, DataPlaneConfig, traffic
from tandem.pipeline.group_blocks import GroupBlockWriter
from tandem.pipeline.replica_set import ReplicaSet
from tandem.pipeline.replica_worker import RolloutReplicaWorker
from tandem.pipeline.sample_store import InlineWriter, SampleWriter
from tandem.protocol import Batch
from tests.pipeline.test_async_dataplane import MODES, ReplicaRecordingTrainer, _files_of
from tests.pipeline.test_async_dataplane import _run as run_counting_reads
from tests.rl.conftest import assert_same_histories
from tests.rl.test_dataplane_step import assert_draws_stay_stored


class DrawRecordingTrainer(ReplicaRecordingTrainer):
    """Also notes what the controller put into and fetched from the data plane while drawing, and
    what each actor update was given (a ``Batch`` or a ``BatchRef``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.draw_traffic: list = []
        self.updates: list = []

    def scored_draw(self, draw, timings):
        start = traffic()
        result = super().scored_draw(draw, timings)
        self.draw_traffic.append(traffic() - start)
        return result

    def update_actor(self, batch):
        self.updates.append(batch)
        return super().update_actor(batch)


def _run(rl_files, out, monkeypatch, *overrides):
    """A 3-step run recording its draws and updates: its history, its trainer and the sample bytes
    the controller read."""
    return run_counting_reads(rl_files, out, monkeypatch, *overrides, trainer_class=DrawRecordingTrainer)


def _comparable(history):  # a block's bytes are not a sample file's: the byte metrics differ
    return [{k: v for k, v in h.items() if not k.startswith("pipeline/inflight")} for h in history]


def _assert_stored_like_off(off, on, refs, absolute: float = 0.0) -> None:
    """The on run trained like the off run (to ``absolute``), its draws stayed in the replica's
    blocks, and the controller put, fetched and serialised no payload byte while drawing or in a step."""
    history_off, _, _ = off
    history_on, _, mapped_on = on
    assert_same_histories(_comparable(history_off), _comparable(history_on), absolute=absolute)
    assert mapped_on == 0  # no sample file mapped, no inline sample's tensors read
    assert_draws_stay_stored(refs)
    steps = len(history_on)
    assert [(t.put_bytes, t.fetched_bytes) for t in refs.draw_traffic] == [(0, 0)] * steps
    assert refs.step_bytes == [0] * steps and refs.left == [[]] * steps
    assert refs.replica_pids and not _files_of(refs.replica_pids | {os.getpid()})
    assert not multiprocessing.active_children()


@pytest.mark.slow  # two 3-step one-step-off runs, with a replica process each
def test_rollout_old_log_probs_stay_stored_under_a_second_name(rl_files, tmp_path, monkeypatch):
    """``pipeline.old_log_probs=rollout``: the updates read ``old_log_probs`` from the replica's block
    as the stored ``rollout_log_probs``, fetched once; the metrics equal the off run's to float32
    rounding. Not bit for bit: the rollout's log-probs are now the old ones, and their last bits
    follow how the engine batched the requests, which differs between runs (two runs of this test,
    off against on: step 1's ``actor/ppo_kl`` 0.0 vs -1.04e-08, then -1.04e-08 vs 0.0; step 3's
    ``actor/pg_loss`` -9.74286e-4 vs -9.74308e-4)."""
    setting = (*MODES["one_step_off"], "pipeline.old_log_probs=rollout")
    off = _run(rl_files, tmp_path / "off", monkeypatch, *setting, "dataplane.enabled=false")
    on = _run(rl_files, tmp_path / "on", monkeypatch, *setting, "dataplane.enabled=true")
    today, refs = off[1], on[1]
    _assert_stored_like_off(off, on, refs, absolute=1e-6)
    assert off[2] > 0  # the off run's controller mapped the sample files
    for batch in today.updates:  # the Batch path: the rename, the same tensor under both names
        assert isinstance(batch, Batch) and batch["old_log_probs"] is batch["rollout_log_probs"]
    for step in refs.updates:
        assert isinstance(step, BatchRef) and "old_log_probs" in step.stored_fields()
        (part,) = [p for p in step.parts if "old_log_probs" in p.fields]
        assert part.stored_name("old_log_probs") == "rollout_log_probs"
    names = refs.plan.names()  # the rename prepares the step; no pass recomputes them
    assert "rollout_old_log_probs" in names["prepare"] and "old_log_probs" not in names["pass"]
    for fetched, expected in zip(refs.update_by_field, refs.update_expected, strict=True):
        assert "old_log_probs" not in fetched and fetched == expected  # the stored field, once


@pytest.mark.slow  # two 3-step one-step-off runs, with a replica process each
def test_inline_samples_stay_in_the_replicas_blocks_with_the_data_plane(rl_files, tmp_path, monkeypatch):
    """``pipeline.sample_store=inline``: with the data plane on the replica keeps its groups in its
    blocks (told to write inline, then to keep them in the store); the metrics equal the off run's,
    whose samples travel with their metadata."""
    setting = (*MODES["one_step_off"], "pipeline.sample_store=inline")
    off = _run(rl_files, tmp_path / "off", monkeypatch, *setting, "dataplane.enabled=false")
    on = _run(rl_files, tmp_path / "on", monkeypatch, *setting, "dataplane.enabled=true")
    _assert_stored_like_off(off, on, on[1])
    assert off[2] > 0 and all(isinstance(d, Batch) for d in off[1].draws)  # inline samples, read


# ---------------------------------------------------------------------- what a replica is told


def _replica_set(sample_store: str, keep_in_store: DataPlaneConfig | None, seeing: set[int]) -> ReplicaSet:
    """A two-replica set, unstarted, whose replicas see this process's files in ``seeing`` only."""
    replicas = object.__new__(ReplicaSet)
    group = SimpleNamespace(world_size=2, ranks_seeing=lambda directory: set(seeing))
    replicas.pipeline = SimpleNamespace(sample_store=sample_store)
    replicas.keep_in_store, replicas.group, replicas.sample_dir = keep_in_store, group, "/dev/shm"
    return replicas


@pytest.mark.parametrize("sample_store", ["auto", "shared_memory", "inline"])
def test_with_the_data_plane_no_replica_sends_inline_and_shm_blocks_need_the_host(sample_store):
    """The data plane off: ``sample_store`` decides (``inline``: both; ``auto``: the one on another
    host; ``shared_memory``: an error). On: no replica sends inline, whatever it says; with the
    ``shm`` engine a replica on another host is an error naming ``dataplane.engine``, with ``ray`` not."""
    off = {"auto": [1], "inline": [0, 1]}
    if sample_store in off:
        assert _replica_set(sample_store, None, {0})._replicas_sending_inline() == off[sample_store]
    else:
        with pytest.raises(ValueError, match="sample_store=shared_memory, but rollout replica 1"):
            _replica_set(sample_store, None, {0})._replicas_sending_inline()
    shm, ray = DataPlaneConfig(), DataPlaneConfig(engine="ray")
    assert _replica_set(sample_store, shm, {0, 1})._replicas_sending_inline() == []
    assert _replica_set(sample_store, ray, set())._replicas_sending_inline() == []
    with pytest.raises(ValueError, match="replica 1 cannot share files .* set dataplane.engine=ray"):
        _replica_set(sample_store, shm, {0})._replicas_sending_inline()


def test_a_replica_told_to_write_inline_and_to_keep_its_groups_in_the_store_keeps_them(tmp_path):
    """In either order, the data plane's writer wins; told only to write inline, it does."""
    blocks = GroupBlockWriter(DataPlaneConfig(directory=str(tmp_path)), 4, 6, 0, None)

    def replica(writer):
        return SimpleNamespace(rank=0, groups=SimpleNamespace(writer=writer))

    told = replica(blocks)
    RolloutReplicaWorker.write_samples_inline(told, [0])
    assert told.groups.writer is blocks
    alone = replica(SampleWriter(str(tmp_path)))
    RolloutReplicaWorker.write_samples_inline(alone, [1])  # another replica's order
    assert isinstance(alone.groups.writer, SampleWriter)
    RolloutReplicaWorker.write_samples_inline(alone, [0])
    assert isinstance(alone.groups.writer, InlineWriter)
