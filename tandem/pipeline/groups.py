"""Prompt groups on a rollout replica: submit ``n`` requests, notice when all finish, store them.

:class:`GroupTracker` runs inside a replica process. It submits each :class:`GroupRequest`'s
responses to the engine (which generates on its own thread), and :meth:`GroupTracker.collect`
packs every group whose responses have all finished into the sample store and returns its
:class:`~tandem.pipeline.sample_queue.GroupMeta`. It also keeps the replica's idle time: the
seconds with nothing to generate.

A group with an :class:`EpisodePrompt` runs agent episodes instead of single requests (through
the replica's :class:`~tandem.agents.rollout.AgentRollout`); its stored tensors then also hold
each episode's prompt (rendered with the tools' schemas) and ``token_mask`` (1 on the model's
tokens, 0 on tool and user turns), and its metadata the conversations.
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
from tandem.agents.trajectory import Trajectory
from tandem.pipeline.sample_queue import EpisodeInfo, GroupMeta
from tandem.pipeline.sample_store import InlineWriter, SampleWriter
from tandem.protocol.generation import Completion
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
    vision-language prompt's ``images``."""

    uid: str
    index: int
    prompt_ids: tuple[int, ...]
    seeds: tuple[int, ...]
    params: SamplingParams
    episode: EpisodePrompt | None = None
    images: ImageInputs | None = None


@dataclass
class _Pending:
    request: GroupRequest
    started: float
    futures: list[Future] = field(default_factory=list)
    remaining: int = field(init=False)
    aborted: bool = False

    def __post_init__(self) -> None:
        self.remaining = len(self.request.seeds)


class GroupTracker:
    """The replica side of the sample queue (see the module docstring)."""

    def __init__(
        self, replica: int, writer: SampleWriter | InlineWriter, agents: AgentRollout | None = None
    ) -> None:
        self.replica = replica
        self.writer = writer
        self.agents = agents
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
                future = self._submit(engine, group, f"{group.uid}/{i}", int(seed))
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
            failed = [c for c in responses if c.finish_reason == "error"]
            if failed:
                raise RuntimeError(
                    f"rollout replica {self.replica}: request {failed[0].request_id} failed: {failed[0].error}"
                )
            if any(c.finish_reason == "abort" for c in responses):
                continue
            metas.append(self._store(pending, responses))
        return metas

    def _store(self, pending: _Pending, responses: list[Completion | Trajectory]) -> GroupMeta:
        """Pack the group's responses (completions, or an agent group's trajectories)."""
        versions = [v for c in responses for v in c.weight_versions]
        tensors = {
            "token_ids": torch.tensor([t for c in responses for t in c.token_ids], dtype=torch.int64),
            "log_probs": torch.tensor([p for c in responses for p in c.log_probs], dtype=torch.float32),
            "versions": torch.tensor(versions, dtype=torch.int64),
            "lengths": torch.tensor([len(c.token_ids) for c in responses], dtype=torch.int64),
        }
        routed = [getattr(c, "routed_experts", None) for c in responses]
        if responses and all(r is not None for r in routed):  # MoE: [prompt + response, L, k] each
            tensors["routed_experts"] = torch.cat(routed)
            tensors["routed_lengths"] = torch.tensor([len(r) for r in routed], dtype=torch.int64)
        episodes: tuple[EpisodeInfo, ...] = ()
        if pending.request.episode is not None:  # trajectories
            tensors["token_mask"] = torch.tensor(
                [m for t in responses for m in t.loss_mask], dtype=torch.int64
            )
            tensors["prompt_ids"] = torch.tensor(
                [p for t in responses for p in t.prompt_ids], dtype=torch.int64
            )
            tensors["prompt_lengths"] = torch.tensor(
                [len(t.prompt_ids) for t in responses], dtype=torch.int64
            )
            episodes = tuple(
                EpisodeInfo(t.messages, t.turns, t.tool_calls, t.tool_errors, t.reward) for t in responses
            )
        sampled = [v for v in versions if v >= 0]  # tool and user tokens carry -1
        group = pending.request
        return GroupMeta(
            uid=group.uid,
            index=group.index,
            replica=self.replica,
            ref=self.writer.write(group.uid, tensors),
            min_version=min(sampled, default=0),
            max_version=max(sampled, default=0),
            finish_reasons=tuple(str(c.finish_reason) for c in responses),
            seconds=time.monotonic() - pending.started,
            episodes=episodes,
        )

    def abort_all(self, engine) -> int:
        """Abort every request in flight (their groups are dropped); returns how many groups.
        An agent episode's current model turn is aborted, which ends the episode."""
        with self._changed:
            groups = list(self._pending.values())
            for pending in groups:
                pending.aborted = True
        for pending in groups:
            for i in range(len(pending.futures)):
                request_id = f"{pending.request.uid}/{i}"
                if pending.request.episode is None:
                    engine.abort(request_id)
                elif self.agents is not None:
                    self.agents.abort_episode(request_id)
        return len(groups)
