"""The streaming sample queue: the controller's view of finished prompt groups, metadata only.

Rollout replicas report each finished group as a :class:`GroupMeta` — ids, weight versions,
lengths, finish reasons and a :class:`~tandem.pipeline.sample_store.SampleRef` to its tensors,
which stay in the producer's shared-memory file until the trainer side pulls them. The queue
orders groups by arrival, hands them out as they are ready, and drops (and counts) groups
that would be trained more than ``staleness_threshold`` versions behind the trainer.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tandem.pipeline.sample_store import InlineSample, SampleRef, release


@dataclass(frozen=True)
class EpisodeInfo:
    """An agent episode's conversation and counts (what its tensors do not hold)."""

    messages: list[dict]
    turns: int
    tool_calls: int
    tool_errors: int
    reward: float | None = None  # an interaction's, when it ended the episode with one


@dataclass(frozen=True)
class GroupMeta:
    """One finished prompt group (its ``n`` responses) as the controller sees it.

    Attributes:
        uid: the group's id (its responses share it, for group-relative advantages).
        index: the prompt's row in the training data.
        replica: the rollout replica that generated it.
        ref: where its tensors are (a shared-memory file, or inline from another host): ``token_ids`` (all responses, concatenated), ``log_probs``,
            ``versions`` (one per token) and ``lengths [n]``.
        min_version / max_version: the oldest and newest weight version among its tokens.
        finish_reasons: one per response.
        seconds: from submission to the last response finishing.
        episodes: an agent group's episodes, one per response (empty otherwise).
    """

    uid: str
    index: int
    replica: int
    ref: SampleRef | InlineSample
    min_version: int
    max_version: int
    finish_reasons: tuple[str, ...]
    seconds: float
    episodes: tuple[EpisodeInfo, ...] = ()

    def staleness(self, trainer_version: int) -> int:
        """How many versions the group's oldest token lags ``trainer_version``."""
        return trainer_version - self.min_version


class SampleQueue:
    """Thread-safe FIFO of :class:`GroupMeta` with a staleness bound (see the module docstring).

    ``staleness_threshold`` None: nothing is dropped (one-step-off bounds staleness by construction).
    """

    def __init__(self, staleness_threshold: int | None) -> None:
        self.staleness_threshold = staleness_threshold
        self._groups: deque[GroupMeta] = deque()
        self._ready = threading.Condition()
        self.dropped_stale = 0  # groups, since start
        self.received = 0

    def put(self, groups: list[GroupMeta]) -> None:
        with self._ready:
            self._groups.extend(groups)
            self.received += len(groups)
            self._ready.notify_all()

    def __len__(self) -> int:
        with self._ready:
            return len(self._groups)

    def take(
        self,
        count: int,
        trainer_version: int,
        check: Callable[[], None] = lambda: None,
        poll_s: float = 0.05,
    ) -> list[GroupMeta]:
        """The first ``count`` groups fresh enough for ``trainer_version``, waiting as long as it takes.

        Stale groups met on the way are dropped (their files released) and counted. ``check``
        runs every ``poll_s`` while waiting; it raises to stop the wait (a dead replica).
        """
        taken: list[GroupMeta] = []
        while True:
            with self._ready:
                while self._groups and len(taken) < count:
                    group = self._groups.popleft()
                    if self._too_stale(group, trainer_version):
                        self.dropped_stale += 1
                        release(group.ref)
                    else:
                        taken.append(group)
                if len(taken) == count:
                    return taken
                self._ready.wait(timeout=poll_s)
            check()

    def _too_stale(self, group: GroupMeta, trainer_version: int) -> bool:
        limit = self.staleness_threshold
        return limit is not None and group.staleness(trainer_version) > limit

    def drain(self) -> int:
        """Drop everything queued (shutdown); returns how many groups were dropped."""
        with self._ready:
            groups, self._groups = list(self._groups), deque()
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
