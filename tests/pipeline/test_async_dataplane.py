"""The asynchronous pipelines with ``dataplane.enabled``: the replicas keep each finished group's
training rows in their data-plane blocks, the controller holds only references and per-row
scalars, and the run's numbers equal today's path (sample files mapped by the controller) step
for step. The fast sibling is tests/pipeline/test_stored_groups.py (the assembly, bit for bit)."""

import multiprocessing
import os
from pathlib import Path

import pytest

from tandem.dataplane.shm import PREFIX as BLOCK_PREFIX
from tandem.pipeline import assemble
from tandem.pipeline.sample_store import PREFIX as SAMPLE_PREFIX
from tests.rl.conftest import assert_same_histories, small_config
from tests.rl.test_dataplane_step import CountingTrainer, assert_draws_stay_stored

TWO_CORES = ("pipeline.trainer_threads=1", "pipeline.rollout_threads=1")
MODES = {
    "one_step_off": ("pipeline.mode=one_step_off",),
    # one replica, no group in flight across a sync: every group is generated on the newest weights
    "fully_async": (
        "pipeline.mode=fully_async",
        "pipeline.staleness_threshold=0",
        "pipeline.partial_rollout=false",
    ),
}


class ReplicaRecordingTrainer(CountingTrainer):
    """Also notes the replicas' processes, to look for their files once the run has ended."""

    def train_step(self):
        self.replica_pids = set(getattr(self, "replica_pids", set())) | set(self.rollout.host_pids())
        return super().train_step()


def _run(rl_files, out, monkeypatch, *overrides, trainer_class=None):
    """A 3-step run of ``trainer_class`` (default :class:`ReplicaRecordingTrainer`): its history, the
    trainer and the sample bytes the controller read (``read_fields``: a sample file mapped, or an
    inline sample's tensors) in it."""
    mapped = []
    read_fields = assemble.read_fields

    def counted(ref, names=None):
        fields = read_fields(ref, names)
        mapped.append(sum(t.nbytes for t in fields.values()))
        return fields

    monkeypatch.setattr(assemble, "read_fields", counted)
    trainer = (trainer_class or ReplicaRecordingTrainer)(
        small_config(rl_files, out, "data.val_path=", "trainer.total_steps=3", *TWO_CORES, *overrides)
    )
    return trainer.fit().history, trainer, sum(mapped)


def _files_of(pids: set[int]) -> list[str]:
    prefixes = tuple(f"{p}-{pid}-" for pid in pids for p in (BLOCK_PREFIX, SAMPLE_PREFIX))
    return [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefixes)]


@pytest.mark.slow  # two 3-step pipeline runs per mode, with a replica process each
@pytest.mark.parametrize("mode", list(MODES))
def test_async_draws_stay_in_the_replicas_blocks_and_train_like_todays_path(
    rl_files, tmp_path, monkeypatch, mode
):
    today, before, mapped_today = _run(
        rl_files, tmp_path / "off", monkeypatch, *MODES[mode], "dataplane.enabled=false"
    )
    stored, refs, mapped_refs = _run(
        rl_files, tmp_path / "on", monkeypatch, *MODES[mode], "dataplane.enabled=true"
    )

    def comparable(history):  # a block's bytes are not a sample file's: the byte metrics differ
        return [{k: v for k, v in h.items() if not k.startswith("pipeline/inflight")} for h in history]

    assert_same_histories(comparable(today), comparable(stored))
    assert mapped_today > 0 and mapped_refs == 0  # the controller no longer maps any sample
    assert_draws_stay_stored(refs)
    assert refs.step_bytes == [0, 0, 0]  # no Batch serialised or rebuilt by the controller in a step
    assert all(h["pipeline/inflight_bytes_max"] > 0 for h in stored[1:])  # the bound counts the blocks
    assert refs.left == [[], [], []]  # each step's blocks released by the step's end
    pids = refs.replica_pids | {os.getpid()}
    assert refs.replica_pids and not _files_of(pids)  # nothing left once the run has ended
    assert not multiprocessing.active_children()
    print(f"sample bytes the controller mapped: today {mapped_today}, refs {mapped_refs}")
