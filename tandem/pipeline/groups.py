"""Prompt groups on a rollout replica: submit ``n`` requests, notice when all finish, store them.

:class:`GroupTracker` runs inside a replica process. It submits each :class:`GroupRequest`'s
responses to the engine (which generates on its own thread), and :meth:`GroupTracker.collect`
packs every group whose responses have all finished into the sample store and returns its
:class:`~tandem.pipeline.sample_queue.GroupMeta`. It also keeps the replica's idle time: the
seconds with nothing to generate.

Backpressure: ``collect`` may be given a byte ``room`` (what the controller's bound on samples
in flight leaves, ``pipeline.max_inflight_bytes``). Finished groups are stored in the order they
finished while they fit; the others wait, packed, in this process's memory (never dropped) for a
later call with room, and the seconds they waited are counted (:meth:`GroupTracker.waited_seconds`).

A group with an :class:`EpisodePrompt` runs agent episodes instead of single requests (through
the replica's :class:`~tandem.agents.rollout.AgentRollout`); its stored tensors then also hold
each episode's prompt (rendered with the tools' schemas) and ``token_mask`` (1 on the model's
tokens, 0 on tool and user turns), and its metadata the conversations (and, for an agent program's
episodes, their splits, metrics and logs: :class:`~tandem.pipeline.sample_queue.EpisodeInfo`).
Aborting an agent group (:meth:`GroupTracker.abort_all`) ends its episodes' current model turns,
or its agent programs' episodes (:meth:`~tandem.agents.program.runner.ProgramRunner.abort`).

With a :class:`~tandem.pipeline.sample_log.SampleLog` (``pipeline.record_schedule``) every group
stored is also appended to the replica's sample log, on disk before its metadata is returned.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tandem.agents.loops import AgentSample
from tandem.agents.segments import SEGMENT_START_FIELD, segment_start_flags
from tandem.agents.trajectory import Trajectory
from tandem.dataplane.images import IMAGE_GRIDS, IMAGE_PIXELS
from tandem.pipeline.group_blocks import EPISODE_PROMPT_LENGTHS, PROMPT_FIELD, GroupBlockWriter
from tandem.pipeline.provenance import request_id
from tandem.pipeline.sample_log import SampleLog
from tandem.pipeline.sample_queue import EpisodeInfo, GroupMeta
from tandem.pipeline.sample_store import InlineWriter, SampleWriter
from tandem.protocol.generation import Completion, raise_failed_requests
from tandem.protocol.images import ImageInputs
from tandem.rollout import RolloutRequest, SamplingParams

if TYPE_CHECKING:
    from tandem.agents.rollout import AgentRollout


@dataclass(frozen=True)
class EpisodePrompt:
    """What an agent episode starts from: the row's chat messages, ``extra_info`` and loop name."""

    messages: tuple[dict, ...]
    extra_info: dict
    agent_name: str = ""


@dataclass(frozen=True)
class GroupRequest:
    """One prompt to answer ``len(seeds)`` times (one response, or agent episode, per seed), with a
    vision-language prompt's ``images``. With the data plane a text prompt travels as its ``place``
    in the training data (its source's key, file and row) and no ``prompt_ids``: the replica reads
    and tokenises the row itself (:func:`tandem.pipeline.requests.read_prompts`)."""

    uid: str
    index: int
    prompt_ids: tuple[int, ...]
    seeds: tuple[int, ...]
    params: SamplingParams
    episode: EpisodePrompt | None = None
    images: ImageInputs | None = None
    place: tuple[str, int, int] | None = None


@dataclass
class _Pending:
    request: GroupRequest
    started: float
    futures: list[Future] = field(default_factory=list)
    remaining: int = field(init=False)
    aborted: bool = False
    packed: tuple[dict[str, torch.Tensor], list] | None = None  # finished: (tensors, responses)
    size: int = 0  # the bytes storing ``packed`` takes (the writer's measure, taken once)
    seconds: float = 0.0  # from submission to the last response finishing
    waiting_since: float | None = None  # when it first found no room in the sample store

    def __post_init__(self) -> None:
        self.remaining = len(self.request.seeds)


class GroupTracker:
    """The replica side of the sample queue (see the module docstring)."""

    def __init__(
        self,
        replica: int,
        writer: SampleWriter | InlineWriter | GroupBlockWriter,
        agents: AgentRollout | None = None,
    ) -> None:
        self.replica = replica
        self.writer = writer
        self.agents = agents
        self._pending: dict[str, _Pending] = {}
        self._finished: list[_Pending] = []
        self._changed = threading.Condition()
        self._idle_since: float | None = time.monotonic()
        self._idle_total = 0.0
        self._waiting: list[_Pending] = []  # finished and packed, not stored for want of room
        self._waited_total = 0.0
        self.sample_log: SampleLog | None = None  # pipeline.record_schedule: each stored group, on disk

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
                future = self._submit(engine, group, request_id(group.uid, i), int(seed))
                pending.futures.append(future)
                future.add_done_callback(lambda _, p=pending: self._one_done(p))

    def _submit(self, engine, group: GroupRequest, request_id: str, seed: int) -> Future:
        if group.episode is None:
            params = dataclasses.replace(group.params, seed=seed)
            return engine.submit(RolloutRequest(request_id, group.prompt_ids, params, group.images))
        if self.agents is None:
            raise ValueError(
                f"prompt group {group.uid!r} is an agent episode, but replica {self.replica} has no agents"
            )
        episode = group.episode
        sample = AgentSample(
            list(episode.messages),
            seed,
            request_id,
            dict(episode.extra_info),
            episode.agent_name,
            group.images,
        )
        return self.agents.submit_episode(sample, group.params)

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

    def waited_seconds(self) -> float:
        """Seconds finished groups waited for room in the sample store (summed over groups)."""
        now = time.monotonic()
        return self._waited_total + sum(now - p.waiting_since for p in self._waiting if p.waiting_since)

    @property
    def waiting(self) -> int:
        """Finished groups waiting for room in the sample store."""
        return len(self._waiting)

    def collect(self, wait_s: float, room: int | None = None, at_least_one: bool = False) -> list[GroupMeta]:
        """Store the finished groups that fit in ``room`` bytes (``None``: all; ``at_least_one``:
        the first even if it alone does not fit) and return their metadata, waiting up to
        ``wait_s`` for a group to finish. Groups that do not fit wait for a later call, in order.

        Aborted groups (shutdown) are left out; a response that failed raises, naming it.
        """

        def fits(pending: _Pending, used: int, first: bool) -> bool:
            return room is None or used + pending.size <= room or (at_least_one and first)

        with self._changed:
            stuck = not self._waiting or not fits(self._waiting[0], 0, True)  # nothing to store now
            if not self._finished and stuck and wait_s > 0:
                self._changed.wait(timeout=wait_s)
            finished, self._finished = self._finished, []
        candidates = self._waiting + [p for p in self._packed(finished) if p.packed is not None]
        self._waiting = []
        metas: list[GroupMeta] = []
        used = 0
        for pending in candidates:
            if self._waiting or not fits(pending, used, not metas):  # later groups keep their place
                if pending.waiting_since is None:
                    pending.waiting_since = time.monotonic()
                self._waiting.append(pending)
                continue
            if pending.waiting_since is not None:
                self._waited_total += time.monotonic() - pending.waiting_since
            used += pending.size
            metas.append(self._store(pending))
        return metas

    def _packed(self, finished: list[_Pending]) -> list[_Pending]:
        """``finished`` with their responses packed (aborted groups, and groups with an aborted
        response, are left unpacked: they are dropped)."""
        for pending in finished:
            if pending.aborted:
                continue
            responses = []
            for i, future in enumerate(pending.futures):
                try:
                    responses.append(future.result())
                except Exception as error:  # an episode that raised (the engine reports errors as results)
                    raise RuntimeError(
                        f"rollout replica {self.replica}: episode {pending.request.uid}/{i} failed: {error}"
                    ) from error
            raise_failed_requests(responses, f"rollout replica {self.replica}")
            if any(c.finish_reason == "abort" for c in responses):
                continue
            tensors = self._pack(pending, responses)
            pending.packed = (tensors, responses)
            pending.size = self.writer.size_of(tensors)
            pending.seconds = time.monotonic() - pending.started
        return finished

    def _pack(self, pending: _Pending, responses: list[Completion | Trajectory]) -> dict[str, torch.Tensor]:
        """The group's tensors, from its responses (completions, or an agent group's trajectories)."""
        tensors = {
            "token_ids": torch.tensor([t for c in responses for t in c.token_ids], dtype=torch.int64),
            "log_probs": torch.tensor([p for c in responses for p in c.log_probs], dtype=torch.float32),
            "versions": torch.tensor([v for c in responses for v in c.weight_versions], dtype=torch.int64),
            "lengths": torch.tensor([len(c.token_ids) for c in responses], dtype=torch.int64),
        }
        routed = [getattr(c, "routed_experts", None) for c in responses]
        if responses and all(r is not None for r in routed):  # MoE: [prompt + response, L, k] each
            tensors["routed_experts"] = torch.cat(routed)
            tensors["routed_lengths"] = torch.tensor([len(r) for r in routed], dtype=torch.int64)
        if pending.request.episode is None and self.writer.needs_prompt:  # rows are built on the replica
            tensors[PROMPT_FIELD] = torch.tensor(pending.request.prompt_ids, dtype=torch.int64)
        images = pending.request.images
        if self.writer.needs_prompt and images is not None and images.num_images:  # stored with its rows
            tensors[IMAGE_PIXELS], tensors[IMAGE_GRIDS] = images.pixel_values, images.image_grid_thw
        if pending.request.episode is not None:  # trajectories
            tensors["token_mask"] = torch.tensor(
                [m for t in responses for m in t.loss_mask], dtype=torch.int64
            )
            tensors[SEGMENT_START_FIELD] = segment_start_flags(responses)  # an agent program's split rows
            tensors[PROMPT_FIELD] = torch.tensor(
                [p for t in responses for p in t.prompt_ids], dtype=torch.int64
            )
            tensors[EPISODE_PROMPT_LENGTHS] = torch.tensor(
                [len(t.prompt_ids) for t in responses], dtype=torch.int64
            )
        return tensors

    def _store(self, pending: _Pending) -> GroupMeta:
        """Store a packed group and make its metadata."""
        tensors, responses = pending.packed  # type: ignore[misc]
        pending.packed = None
        versions = [v for c in responses for v in c.weight_versions]
        episodes: tuple[EpisodeInfo, ...] = ()
        if pending.request.episode is not None:
            program = self.agents is not None and self.agents.program is not None
            episodes = tuple(
                EpisodeInfo(
                    t.messages, t.turns, t.tool_calls, t.tool_errors, t.reward,
                    t.splits, dict(t.metrics), dict(t.program_log) if program else None,
                )
                for t in responses
            )  # fmt: skip
        sampled = [v for v in versions if v >= 0]  # tool and user tokens carry -1
        group = pending.request
        logged = self.sample_log.append(group.uid, tensors) if self.sample_log is not None else ""
        return GroupMeta(
            uid=group.uid,
            index=group.index,
            replica=self.replica,
            ref=self.writer.write(group.uid, tensors),
            min_version=min(sampled, default=0),
            max_version=max(sampled, default=0),
            finish_reasons=tuple(str(c.finish_reason) for c in responses),
            seconds=pending.seconds,
            episodes=episodes,
            seeds=tuple(int(seed) for seed in group.seeds),
            request_ids=tuple(request_id(group.uid, i) for i in range(len(responses))),
            sample_log=logged,
        )

    def abort_all(self, engine) -> int:
        """Abort every request in flight (their groups are dropped); returns how many groups.
        An agent episode's current model turn is aborted, which ends the episode."""
        with self._changed:
            groups = list(self._pending.values())
            for pending in groups:
                pending.aborted = True
        groups += self._waiting  # finished, never stored: dropped with the rest
        self._waiting = []
        for pending in groups:
            for i in range(len(pending.futures)):
                name = request_id(pending.request.uid, i)
                if pending.request.episode is None:
                    engine.abort(name)
                elif self.agents is not None:
                    self.agents.abort_episode(name)
        return len(groups)
