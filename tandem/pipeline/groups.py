"""Prompt groups on a rollout replica: submit ``n`` requests, notice when all finish, store them.

:class:`GroupTracker` runs inside a replica process. It submits each :class:`GroupRequest`'s
responses to the engine (which generates on its own thread), and :meth:`GroupTracker.collect`
packs every group whose responses have all finished into the sample store and returns its
:class:`~tandem.pipeline.sample_queue.GroupMeta`. It also keeps the replica's idle time: the
seconds with nothing to generate.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tandem.pipeline.sample_queue import GroupMeta
from tandem.pipeline.sample_store import InlineWriter, SampleWriter
from tandem.rollout import RolloutRequest, SamplingParams
from tandem.rollout.types import Completion


@dataclass(frozen=True)
class GroupRequest:
    """One prompt to answer ``len(seeds)`` times (one response per seed)."""

    uid: str
    index: int
    prompt_ids: tuple[int, ...]
    seeds: tuple[int, ...]
    params: SamplingParams


@dataclass
class _Pending:
    request: GroupRequest
    started: float
    futures: list[Future] = field(default_factory=list)
    remaining: int = field(init=False)

    def __post_init__(self) -> None:
        self.remaining = len(self.request.seeds)


class GroupTracker:
    """The replica side of the sample queue (see the module docstring)."""

    def __init__(self, replica: int, writer: SampleWriter | InlineWriter) -> None:
        self.replica = replica
        self.writer = writer
        self._pending: dict[str, _Pending] = {}
        self._finished: list[_Pending] = []
        self._changed = threading.Condition()
        self._idle_since: float | None = time.monotonic()
        self._idle_total = 0.0

    def start(self, engine, groups: list[GroupRequest]) -> None:
        """Submit every response of ``groups`` to ``engine`` (returns at once)."""
        with self._changed:
            if groups and self._idle_since is not None:
                self._idle_total += time.monotonic() - self._idle_since
                self._idle_since = None
        for group in groups:
            if group.uid in self._pending:
                raise ValueError(f"prompt group {group.uid!r} is already in flight on replica {self.replica}")
            pending = _Pending(group, time.monotonic())
            with self._changed:
                self._pending[group.uid] = pending
            for i, seed in enumerate(group.seeds):
                params = dataclasses.replace(group.params, seed=int(seed))
                future = engine.submit(RolloutRequest(f"{group.uid}/{i}", group.prompt_ids, params))
                pending.futures.append(future)
                future.add_done_callback(lambda _, p=pending: self._one_done(p))

    def _one_done(self, pending: _Pending) -> None:
        with self._changed:
            pending.remaining -= 1
            if pending.remaining == 0:
                self._pending.pop(pending.request.uid, None)
                self._finished.append(pending)
                if not self._pending:
                    self._idle_since = time.monotonic()
                self._changed.notify_all()

    @property
    def in_flight(self) -> int:
        with self._changed:
            return len(self._pending)

    def idle_seconds(self) -> float:
        """Seconds with no group in flight, since the tracker was made."""
        with self._changed:
            running = 0.0 if self._idle_since is None else time.monotonic() - self._idle_since
            return self._idle_total + running

    def collect(self, wait_s: float) -> list[GroupMeta]:
        """Store every finished group and return its metadata, waiting up to ``wait_s`` for one.

        Aborted groups (shutdown) are left out; a response that failed raises, naming it.
        """
        with self._changed:
            if not self._finished and wait_s > 0:
                self._changed.wait(timeout=wait_s)
            finished, self._finished = self._finished, []
        metas = []
        for pending in finished:
            completions: list[Completion] = [f.result() for f in pending.futures]
            failed = [c for c in completions if c.finish_reason == "error"]
            if failed:
                raise RuntimeError(
                    f"rollout replica {self.replica}: request {failed[0].request_id} failed: {failed[0].error}"
                )
            if any(c.finish_reason == "abort" for c in completions):
                continue
            metas.append(self._store(pending, completions))
        return metas

    def _store(self, pending: _Pending, completions: list[Completion]) -> GroupMeta:
        versions = [v for c in completions for v in c.weight_versions]
        tensors = {
            "token_ids": torch.tensor([t for c in completions for t in c.token_ids], dtype=torch.int64),
            "log_probs": torch.tensor([p for c in completions for p in c.log_probs], dtype=torch.float32),
            "versions": torch.tensor(versions, dtype=torch.int64),
            "lengths": torch.tensor([len(c.token_ids) for c in completions], dtype=torch.int64),
        }
        group = pending.request
        return GroupMeta(
            uid=group.uid,
            index=group.index,
            replica=self.replica,
            ref=self.writer.write(group.uid, tensors),
            min_version=min(versions, default=0),
            max_version=max(versions, default=0),
            finish_reasons=tuple(str(c.finish_reason) for c in completions),
            seconds=time.monotonic() - pending.started,
        )

    def abort_all(self, engine) -> int:
        """Abort every request in flight (their groups are dropped); returns how many groups."""
        with self._changed:
            groups = list(self._pending.values())
        for pending in groups:
            for i in range(len(pending.futures)):
                engine.abort(f"{pending.request.uid}/{i}")
        return len(groups)
