"""The streaming sample queue: the controller's view of finished prompt groups, metadata only.

Rollout replicas report each finished group as a :class:`GroupMeta` — ids, weight versions,
lengths, finish reasons and a :class:`~tandem.pipeline.sample_store.SampleRef` to its tensors,
which stay in the producer's shared-memory file until the trainer side pulls them. The queue
orders groups by arrival, hands them out as they are ready, and drops (and counts) groups
that would be trained more than ``staleness_threshold`` versions behind the trainer.

It also bounds the bytes waiting in it (``pipeline.max_inflight_bytes``): each of the
``producers`` replicas has an equal share, and :meth:`SampleQueue.room` tells a replica's driver
how many bytes it may store now. A group leaves the count when a step takes it (the trainer
then owns it until it is assembled and released), so the trainer's wait never waits on room.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.dataplane import BatchRef
from tandem.pipeline.sample_store import InlineSample, SampleRef, release, stored_nbytes


@dataclass(frozen=True)
class EpisodeInfo:
    """An agent episode's conversation and counts (what its tensors do not hold); an agent
    program's episode also has its splits, its own metrics and its log (``program_log`` is None
    for the other loops)."""

    messages: list[dict]
    turns: int
    tool_calls: int
    tool_errors: int
    reward: float | None = None  # an interaction's or a program's, when it ended the episode with one
    program_splits: int = 0
    program_metrics: dict[str, float] = field(default_factory=dict)
    program_log: dict[str, str] | None = None


@dataclass(frozen=True)
class GroupMeta:
    """One finished prompt group (its ``n`` responses) as the controller sees it.

    Attributes:
        uid: the group's id (its responses share it, for group-relative advantages).
        index: the prompt's row in the training data.
        replica: the rollout replica that generated it.
        ref: where its tensors are (a shared-memory file, or inline from another host): ``token_ids`` (all responses, concatenated), ``log_probs``,
            ``versions`` (one per token) and ``lengths [n]``; or, with ``dataplane.enabled``, a
            ``BatchRef`` to its ``n`` training rows in the replica's data-plane block
            (:mod:`tandem.pipeline.group_blocks`).
        min_version / max_version: the oldest and newest weight version among its tokens.
        finish_reasons: one per response.
        seconds: from submission to the last response finishing.
        episodes: an agent group's episodes, one per response (empty otherwise).
        seeds: each response's sampling seed (:mod:`tandem.pipeline.provenance`).
        request_ids: each response's request id on the replica's engine.
        generation: the replica's restart generation when it reported the group (0: its first
            process), stamped by the replica's driver (:class:`~tandem.pipeline.fleet.RolloutFleet`).
        sample_log: with ``pipeline.record_schedule``, the group's entry in its replica's sample
            log (``<file>@<offset>``, :mod:`tandem.pipeline.sample_log`); empty otherwise.
    """

    uid: str
    index: int
    replica: int
    ref: SampleRef | InlineSample | BatchRef
    min_version: int
    max_version: int
    finish_reasons: tuple[str, ...]
    seconds: float
    episodes: tuple[EpisodeInfo, ...] = ()
    seeds: tuple[int, ...] = ()
    request_ids: tuple[str, ...] = ()
    generation: int = 0
    sample_log: str = ""

    def staleness(self, trainer_version: int) -> int:
        """How many versions the group's oldest token lags ``trainer_version``."""
        return trainer_version - self.min_version


class SampleQueue:
    """Thread-safe FIFO of :class:`GroupMeta` with a staleness bound (see the module docstring).

    ``staleness_threshold`` None: nothing is dropped (one-step-off bounds staleness by construction).
    ``max_bytes`` None: the queued bytes are counted but not bounded.
    """

    def __init__(
        self, staleness_threshold: int | None, max_bytes: int | None = None, producers: int = 1
    ) -> None:
        self.staleness_threshold = staleness_threshold
        self.max_bytes = max_bytes
        self._share = None if max_bytes is None else max_bytes // producers
        self._groups: deque[GroupMeta] = deque()
        self._ready = threading.Condition()
        self.dropped_stale = 0  # groups, since start
        self.received = 0
        self._held: dict[int, int] = {}  # queued bytes, by producing replica
        self._peak = 0  # the most bytes queued at once since the last read_peak()

    def put(self, groups: list[GroupMeta]) -> None:
        with self._ready:
            self._groups.extend(groups)
            self.received += len(groups)
            for group in groups:
                self._held[group.replica] = self._held.get(group.replica, 0) + stored_nbytes(group.ref)
            self._peak = max(self._peak, sum(self._held.values()))
            self._ready.notify_all()

    def _popleft(self) -> GroupMeta:
        group = self._groups.popleft()
        self._held[group.replica] -= stored_nbytes(group.ref)
        return group

    @property
    def held_bytes(self) -> int:
        """The bytes of the queued groups."""
        with self._ready:
            return sum(self._held.values())

    def read_peak(self) -> int:
        """The most bytes queued at once since the last call (then the count starts again from now)."""
        with self._ready:
            peak, self._peak = self._peak, sum(self._held.values())
            return peak

    def room(self, producer: int) -> tuple[int | None, bool]:
        """How many bytes replica ``producer`` may store now (``None``: no bound), and whether it may
        store one group beyond that (it has nothing queued, so a group larger than its whole share
        still gets through)."""
        if self._share is None:
            return None, False
        with self._ready:
            held = self._held.get(producer, 0)
            return max(self._share - held, 0), held == 0

    def __len__(self) -> int:
        with self._ready:
            return len(self._groups)

    def take(
        self,
        count: int,
        trainer_version: int,
        check: Callable[[], None] = lambda: None,
        poll_s: float = 0.05,
        chunk: int = 0,
        on_chunk: Callable[[list[GroupMeta]], None] | None = None,
    ) -> list[GroupMeta]:
        """The first ``count`` groups fresh enough for ``trainer_version``, waiting as long as it takes.

        Stale groups met on the way are dropped (their files released) and counted. ``check``
        runs every ``poll_s`` while waiting; it raises to stop the wait (a dead replica). With
        ``on_chunk``, every ``chunk`` groups taken while the wait goes on are handed to it at once,
        in order, outside the queue's lock (the trainer's forward passes on them:
        ``pipeline.stream_forward``); the groups of the last, unfinished chunk are not (the caller
        has all ``count`` when this returns).
        """
        taken: list[GroupMeta] = []
        handed = 0
        while True:
            with self._ready:
                while self._groups and len(taken) < count:
                    group = self._popleft()
                    if self._too_stale(group, trainer_version):
                        self.dropped_stale += 1
                        release(group.ref)
                    else:
                        taken.append(group)
                if len(taken) == count:
                    return taken
                if on_chunk is None or len(taken) - handed < chunk:
                    self._ready.wait(timeout=poll_s)
            while on_chunk is not None and len(taken) - handed >= chunk > 0:
                on_chunk(taken[handed : handed + chunk])
                handed += chunk
            check()

    def _too_stale(self, group: GroupMeta, trainer_version: int) -> bool:
        limit = self.staleness_threshold
        return limit is not None and group.staleness(trainer_version) > limit

    def drain(self) -> int:
        """Drop everything queued (shutdown); returns how many groups were dropped."""
        with self._ready:
            groups, self._groups = list(self._groups), deque()
            self._held.clear()
        for group in groups:
            release(group.ref)
        return len(groups)


def wait_until(predicate: Callable[[], bool], check: Callable[[], None], poll_s: float = 0.05) -> float:
    """Poll ``predicate`` until true, running ``check`` between polls; returns the seconds waited."""
    started = time.monotonic()
    while not predicate():
        check()
        time.sleep(poll_s)
    return time.monotonic() - started
