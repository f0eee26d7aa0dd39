"""``RolloutFleet``: the controller's side of the rollout replicas in an asynchronous pipeline.

One driver thread per replica hands it the prompt groups assigned to it (``start_groups``,
which returns at once: the replica's engine generates on its own thread) and polls it for
finished groups (``collect``), whose metadata goes into the :class:`SampleQueue`. Each poll
passes the room the queue's byte bound leaves the replica (:meth:`SampleQueue.room`); while it
has none, the driver starts no new groups there. A replica
that dies, raises or does not answer within ``timeout_s`` stops its driver; the error, naming
the replica, is raised by the next :meth:`check` — the trainer's wait calls it every poll,
so a dead replica surfaces within a second rather than as a hang. The fleet remembers which
groups each replica holds, so that after the controller has restarted a failed replica
:meth:`revive` hands the groups it lost to the new one.

A replica runs one call at a time, so a long call (a weight sync, validation) would hold up
the drivers' polls behind it; the controller brackets such calls with :meth:`hold`, during
which the drivers send nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from tandem.errors import RolloutReplicaError
from tandem.pipeline.groups import GroupRequest
from tandem.pipeline.sample_queue import SampleQueue
from tandem.protocol.generation import Completion, raise_failed_requests
from tandem.rollout import RolloutRequest

COLLECT_WAIT_S = 0.02  # a replica's collect call waits this long for a group to finish (new work waits too)


class RolloutFleet:
    """Drives the replicas of ``group`` (a worker group of ``RolloutReplicaWorker``); see the module docstring."""

    def __init__(self, group: Any, queue: SampleQueue, timeout_s: float) -> None:
        self.group = group
        self.queue = queue
        self.timeout_s = timeout_s
        self.size = group.world_size
        self._todo: list[deque[GroupRequest]] = [deque() for _ in range(self.size)]
        self._assigned: list[dict[str, GroupRequest]] = [{} for _ in range(self.size)]  # not yet reported
        self._idle = [0.0] * self.size
        self._idle_before = [0.0] * self.size  # idle seconds of a replica's earlier processes
        self._waited = [0.0] * self.size  # seconds its finished groups waited for room in the queue
        self._waited_before = [0.0] * self.size
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._holding = False
        self._calls = threading.Condition()  # drivers send under it; hold() waits on it
        self.failures: dict[int, RolloutReplicaError] = {}  # by rank, until revived
        self.driver_errors: dict[int, Exception] = {}  # by rank: a driver thread that failed on this side
        self._generation = [0] * self.size  # a driver whose rank's generation moved on retires
        self._threads = [self._start_driver(rank) for rank in range(self.size)]

    # ------------------------------------------------------------------ controller calls
    def submit(self, groups: list[GroupRequest]) -> None:
        """Assign each group to the replica with the fewest groups outstanding."""
        with self._lock:
            for group in groups:
                rank = min(range(self.size), key=lambda r: len(self._assigned[r]))
                self._assigned[rank][group.uid] = group
                self._todo[rank].append(group)

    @property
    def outstanding(self) -> int:
        """Groups assigned to replicas and not yet in the queue."""
        with self._lock:
            return sum(len(assigned) for assigned in self._assigned)

    def idle_seconds(self) -> list[float]:
        """Each replica's seconds with nothing to generate, since the fleet started."""
        with self._lock:
            return [before + now for before, now in zip(self._idle_before, self._idle, strict=True)]

    def waited_seconds(self) -> list[float]:
        """Each replica's seconds that finished groups waited for room (summed over its groups)."""
        with self._lock:
            return [before + now for before, now in zip(self._waited_before, self._waited, strict=True)]

    @property
    def error(self) -> RolloutReplicaError | None:
        """The first replica failure not yet revived, if any."""
        failures = dict(self.failures)
        return failures[min(failures)] if failures else None

    def revive(self, rank: int) -> int:
        """Rank ``rank``'s replica was restarted (its old process is gone): a new driver hands the
        new replica every group the old one had not reported. Returns how many groups that is.

        The old driver retires first: it sends nothing more, and what its last call to the dead
        process brought back is counted before the lost groups are.
        """
        with self._calls:
            self._generation[rank] += 1
            self._calls.notify_all()
        self._threads[rank].join(timeout=self.timeout_s)
        with self._lock:
            lost = list(self._assigned[rank].values())
            self._todo[rank] = deque(lost)
            self._idle_before[rank] += self._idle[rank]
            self._idle[rank] = 0.0
            self._waited_before[rank] += self._waited[rank]
            self._waited[rank] = 0.0
            self.failures.pop(rank, None)
        self._threads[rank] = self._start_driver(rank)
        return len(lost)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """No driver call is sent inside this block (calls already sent finish first, as they are
        queued ahead of the block's own)."""
        with self._calls:
            self._holding = True
        try:
            yield
        finally:
            with self._calls:
                self._holding = False
                self._calls.notify_all()

    def check(self) -> None:
        """Raise the first failure of a replica's driver thread on the controller's side (a
        ``RuntimeError`` naming the replica, caused by it: the run cannot go on), else the first
        replica failure (see the module docstring)."""
        with self._lock:
            broken = dict(self.driver_errors)
        if broken:
            rank = min(broken)
            raise RuntimeError(
                f"the controller's driver of rollout replica {rank} failed: {type(broken[rank]).__name__}: "
                f"{broken[rank]}"
            ) from broken[rank]
        error = self.error
        if error is not None:
            raise error

    def generate(self, requests: list[RolloutRequest]) -> list[Completion]:
        """Completions of ``requests`` in order, spread over the replicas (validation); a request
        that failed raises, naming it (:func:`~tandem.protocol.generation.raise_failed_requests`)."""
        results = self.on_each("generate", [(requests[rank :: self.size],) for rank in range(self.size)])
        ordered: list[Completion] = [None] * len(requests)  # type: ignore[list-item]
        for rank, completions in enumerate(results):
            ordered[rank :: self.size] = completions
        raise_failed_requests(ordered, "validation on the rollout replicas")
        return ordered

    def on_each(self, method: str, shares: list[tuple | None]) -> list[Any]:
        """Replica ``rank``'s ``method(*shares[rank])`` on every replica at once, between the drivers'
        calls (:meth:`hold`); their results in rank order (``None`` where a share is ``None``: no call)."""
        with self.hold():
            handles = [
                None if args is None else self._submit(rank, method, *args)
                for rank, args in enumerate(shares)
            ]
            return [None if h is None else self._result(rank, h, None) for rank, h in enumerate(handles)]

    def close(self) -> None:
        """Stop the drivers, abort what the replicas still generate, drop what is queued."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout_s)
        if self.error is None:
            for rank in range(self.size):
                with contextlib.suppress(RolloutReplicaError):  # it is going away anyway
                    self._result(rank, self._submit(rank, "abort_all"), self.timeout_s)
        self.queue.drain()

    # ------------------------------------------------------------------ the drivers
    def _start_driver(self, rank: int) -> threading.Thread:
        thread = threading.Thread(target=self._drive, args=(rank,), name=f"tandem-fleet-{rank}", daemon=True)
        thread.start()
        return thread

    def _drive(self, rank: int) -> None:
        generation = self._generation[rank]
        try:
            while not self._stop.is_set():
                room, one_more = self.queue.room(rank)
                todo: list[GroupRequest] = []
                if room != 0 or one_more:  # a replica whose share of the queue is full starts nothing
                    with self._lock:
                        todo = list(self._todo[rank])
                        self._todo[rank].clear()
                if todo:
                    self._call(rank, generation, "start_groups", todo)
                groups, idle, waited = self._call(rank, generation, "collect", COLLECT_WAIT_S, room, one_more)
                groups = [dataclasses.replace(g, generation=generation) for g in groups]  # provenance
                with self._lock:
                    for group in groups:
                        self._assigned[rank].pop(group.uid, None)
                    self._idle[rank] = idle
                    self._waited[rank] = waited
                self.queue.put(groups)
        except _Retired:
            return
        except RolloutReplicaError as error:
            with self._lock:
                if generation == self._generation[rank]:
                    self.failures[rank] = error
        except Exception as error:  # the controller's side failed (the queue, a store): no restart mends it
            with self._lock:
                if generation == self._generation[rank]:
                    self.driver_errors[rank] = error

    def _submit(self, rank: int, method: str, *args: Any) -> Any:
        try:
            return self.group.backend.submit(rank, method, args, {})
        except Exception as error:
            raise RolloutReplicaError(
                f"rollout replica {rank} cannot take {method}: {error}", rank
            ) from error

    def _result(self, rank: int, handle: Any, timeout: float | None) -> Any:
        started = time.monotonic()
        try:
            return self.group.backend.result(rank, handle, timeout)
        except TimeoutError:
            raise RolloutReplicaError(
                f"rollout replica {rank} did not answer within {time.monotonic() - started:.0f} s "
                "(pipeline.replica_timeout_s); it is hung or overloaded",
                rank,
            ) from None
        except Exception as error:
            raise RolloutReplicaError(f"rollout replica {rank} failed: {error}", rank) from error

    def _call(self, rank: int, generation: int, method: str, *args: Any) -> Any:
        """A driver's call: sent only while not held and while the driver is its rank's current
        one, answered within ``timeout_s``."""
        with self._calls:
            while self._holding and not self._stop.is_set() and generation == self._generation[rank]:
                self._calls.wait(timeout=0.1)
            if generation != self._generation[rank]:
                raise _Retired
            handle = self._submit(rank, method, *args)
        return self._result(rank, handle, self.timeout_s)


class _Retired(Exception):
    """A driver whose replica was restarted under it stops (:meth:`RolloutFleet.revive`)."""
