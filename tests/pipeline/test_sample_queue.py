"""The sample queue: FIFO hand-out, the staleness bound, and waits that a failure stops."""

import threading
import time

import pytest
import torch

from tandem.pipeline.sample_queue import GroupMeta, SampleQueue
from tandem.pipeline.sample_store import SampleWriter


def _group(writer, uid: str, min_version: int) -> GroupMeta:
    ref = writer.write(uid, {"token_ids": torch.ones(2, dtype=torch.int64)})
    return GroupMeta(uid, 0, 0, ref, min_version, min_version, ("stop",), 0.1)


def test_groups_come_out_in_arrival_order(tmp_path):
    writer = SampleWriter(str(tmp_path))
    queue = SampleQueue(staleness_threshold=None)
    queue.put([_group(writer, f"g{i}", 0) for i in range(5)])
    assert [g.uid for g in queue.take(3, trainer_version=9)] == ["g0", "g1", "g2"]
    assert len(queue) == 2 and queue.dropped_stale == 0  # no threshold: nothing is too old


def test_groups_over_the_threshold_are_dropped_counted_and_released(tmp_path):
    writer = SampleWriter(str(tmp_path))
    queue = SampleQueue(staleness_threshold=1)
    old, fresh = _group(writer, "old", 2), [_group(writer, f"f{i}", v) for i, v in enumerate((3, 4, 4))]
    queue.put([old, *fresh])
    taken = queue.take(3, trainer_version=4)  # staleness: old 2 (> 1), the rest 1, 0, 0
    assert [g.uid for g in taken] == ["f0", "f1", "f2"]
    assert max(g.staleness(4) for g in taken) <= 1
    assert queue.dropped_stale == 1 and not (tmp_path / old.ref.path).exists()


def test_take_waits_for_a_producer(tmp_path):
    writer = SampleWriter(str(tmp_path))
    queue = SampleQueue(staleness_threshold=None)

    def produce():
        for i in range(4):
            time.sleep(0.05)
            queue.put([_group(writer, f"g{i}", 0)])

    threading.Thread(target=produce).start()
    assert [g.uid for g in queue.take(4, 0)] == ["g0", "g1", "g2", "g3"]


def test_a_failing_check_ends_the_wait(tmp_path):
    queue = SampleQueue(staleness_threshold=None)
    deadline = time.monotonic() + 0.2

    def check():
        if time.monotonic() > deadline:
            raise RuntimeError("rollout replica 3 died")

    with pytest.raises(RuntimeError, match="replica 3"):
        queue.take(1, 0, check)


def test_drain_releases_everything(tmp_path):
    writer = SampleWriter(str(tmp_path))
    queue = SampleQueue(staleness_threshold=None)
    queue.put([_group(writer, f"g{i}", 0) for i in range(3)])
    assert queue.drain() == 3 and len(queue) == 0 and not list(tmp_path.iterdir())


def _from(writer, uid: str, replica: int, tokens: int) -> GroupMeta:
    ref = writer.write(uid, {"token_ids": torch.ones(tokens, dtype=torch.int64)})
    return GroupMeta(uid, 0, replica, ref, 0, 0, ("stop",), 0.1)


def test_each_replica_gets_an_equal_share_of_the_byte_bound_and_taking_frees_it(tmp_path):
    writer = SampleWriter(str(tmp_path))
    queue = SampleQueue(staleness_threshold=None, max_bytes=4096, producers=2)
    assert queue.room(0) == (2048, True) and queue.room(1) == (2048, True)  # empty: one may exceed
    queue.put([_from(writer, "a", 0, 128), _from(writer, "b", 0, 64)])  # 1024 + 512 bytes
    queue.put([_from(writer, "c", 1, 256)])  # 2048 bytes: replica 1's share is full
    assert queue.held_bytes == 1024 + 512 + 2048
    assert queue.room(0) == (2048 - 1536, False) and queue.room(1) == (0, False)
    assert [g.uid for g in queue.take(1, 0)] == ["a"]  # a taken group leaves the count
    assert queue.held_bytes == 512 + 2048 and queue.room(0) == (2048 - 512, False)
    assert queue.read_peak() == 1024 + 512 + 2048  # the most held at once, then from now on
    assert queue.read_peak() == 512 + 2048
    queue.drain()
    assert queue.held_bytes == 0 and queue.room(1) == (2048, True)


def test_without_a_bound_bytes_are_counted_and_room_is_unlimited(tmp_path):
    queue = SampleQueue(staleness_threshold=None)
    queue.put([_from(SampleWriter(str(tmp_path)), "a", 3, 8)])
    assert queue.room(3) == (None, False) and queue.held_bytes == 64
