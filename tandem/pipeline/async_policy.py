"""The asynchronous modes' rules: how many prompt groups may be out, when the weights go to the replicas.

:class:`~tandem.pipeline.runner.AsyncRollout` tells its policy each event of the run (the pipeline
starts, a draw is about to take its groups, a draw has taken them, the trainer has new weights)
and does what the returned :class:`Action` says: sync the trainer's weights to the replicas
(after they have drained, if asked), then hand out prompt groups up to :meth:`allowance`. The
policy never calls anything itself, so each mode's schedule can be read, and tested, as a table.

* :class:`OneStepOff` (``pipeline.mode=one_step_off``): each draw's groups are handed out as the
  draw before them is taken; once a step has taken its first draw the replicas, idle by then,
  receive the weights of the step before (staleness is exactly 0 or 1). Nothing is dropped.
* :class:`FullyAsync` (``pipeline.mode=fully_async``): a group may start only while it can still
  be trained within ``pipeline.staleness_threshold`` versions of the weights it starts under
  (counting groups already handed out); groups the queue drops as too stale, and those a
  further draw consumes (dynamic sampling), are handed out again on top. Every
  ``pipeline.trigger_parameter_sync_step`` trainer versions the weights go out, interrupting the
  running requests when ``pipeline.partial_rollout`` is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tandem.pipeline.config import PipelineConfig


@dataclass(frozen=True)
class Action:
    """What the pipeline does at one event: first, when ``sync`` is set, send the trainer's weights
    to the replicas, their running requests doing ``sync`` (``keep``, ``wait`` or ``abort``: see
    :func:`tandem.checkpoint_engine.roles.start_weight_sync`), having waited for every group handed
    out to come back when ``drain``; then, when ``hand_out``, hand out groups up to the allowance."""

    sync: str | None = None
    drain: bool = False
    hand_out: bool = False


NOTHING = Action()


class AsyncPolicy(Protocol):
    """One asynchronous mode's schedule (see the module docstring)."""

    staleness_threshold: int | None  # the queue drops groups staler than this (None: never)
    restart_pause: str  # what the running requests do at the sync that follows a replica restart

    def start(self, trainer_version: int) -> Action:
        """The pipeline starts against a trainer holding ``trainer_version`` (a resumed run's step)."""
        ...

    def drawing(self, draw: int) -> Action:
        """A step's ``draw``-th draw (from 1) is about to take its groups."""
        ...

    def taken(self, rollout_version: int, trainer_version: int) -> Action:
        """A draw has taken its groups; the replicas hold ``rollout_version``, the trainer ``trainer_version``."""
        ...

    def updated(self, version: int) -> Action:
        """The trainer now holds weights ``version``."""
        ...

    def allowance(self, rollout_version: int, dropped_stale: int) -> int:
        """Prompt groups that may have been handed out since the start, the replicas holding
        ``rollout_version`` and the queue having dropped ``dropped_stale`` groups as too stale."""
        ...


class OneStepOff:
    """``pipeline.mode=one_step_off`` (see the module docstring): ``groups`` prompt groups a draw."""

    staleness_threshold = None
    restart_pause = "wait"

    def __init__(self, groups: int) -> None:
        self.groups = groups
        self.draws = 0  # draws taken since the start

    def start(self, trainer_version: int) -> Action:
        return Action(sync="abort" if trainer_version > 0 else None, hand_out=True)

    def drawing(self, draw: int) -> Action:
        return NOTHING

    def taken(self, rollout_version: int, trainer_version: int) -> Action:
        self.draws += 1
        behind = rollout_version < trainer_version
        return Action(sync="keep" if behind else None, drain=behind, hand_out=True)

    def updated(self, version: int) -> Action:
        return NOTHING

    def allowance(self, rollout_version: int, dropped_stale: int) -> int:
        return self.groups * (self.draws + 1)  # the draws taken, and the next one


class FullyAsync:
    """``pipeline.mode=fully_async`` (see the module docstring): ``groups`` prompt groups a draw,
    ``pipeline``'s staleness threshold, sync interval and ``partial_rollout``."""

    def __init__(self, groups: int, pipeline: PipelineConfig) -> None:
        self.groups = groups
        self.staleness_threshold: int | None = pipeline.staleness_threshold
        self.sync_every = pipeline.trigger_parameter_sync_step
        self.sync_pause = "keep" if pipeline.partial_rollout else "wait"
        self.restart_pause = self.sync_pause
        self.start_version = 0  # the trainer's version when the pipeline started
        self.redrawn = 0  # groups consumed by further draws (dynamic sampling), replaced on top

    def start(self, trainer_version: int) -> Action:
        self.start_version = trainer_version
        return Action(sync="abort" if trainer_version > 0 else None, hand_out=True)

    def drawing(self, draw: int) -> Action:
        if draw == 1:
            return NOTHING
        self.redrawn += self.groups
        return Action(hand_out=True)

    def taken(self, rollout_version: int, trainer_version: int) -> Action:
        return NOTHING

    def updated(self, version: int) -> Action:
        sync = self.sync_pause if version % self.sync_every == 0 else None
        return Action(sync=sync, hand_out=True)

    def allowance(self, rollout_version: int, dropped_stale: int) -> int:
        assert self.staleness_threshold is not None
        ahead = rollout_version - self.start_version + self.staleness_threshold + 1
        return ahead * self.groups + dropped_stale + self.redrawn


def async_policy(pipeline: PipelineConfig, groups: int) -> AsyncPolicy:
    """The policy of ``pipeline.mode`` (``one_step_off`` or ``fully_async``), ``groups`` groups a draw."""
    if pipeline.mode == "one_step_off":
        return OneStepOff(groups)
    if pipeline.mode == "fully_async":
        return FullyAsync(groups, pipeline)
    raise ValueError(
        f"pipeline.mode={pipeline.mode} runs no rollout replicas; use one_step_off or fully_async"
    )
