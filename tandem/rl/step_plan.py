"""``StepPlan``: the stages one RL step runs, built once from the config and the stage registry.

Every registered stage (:mod:`tandem.rl.stages`, and a plugin's) declares its slot and when it
applies; :func:`build_step_plan` asks each of them, so the trainer never asks which algorithm
runs: ReMax contributes a draw stage, DAPO a collect stage, online DPO an update, distillation
a pass, GKD a pass and a view stage. Where the old log-probs come from is
``TrainConfig.old_log_probs_source``; the plan carries it. The run prints the plan
(:func:`tandem.rl.plan.run_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.rl.stages import registered_stages
from tandem.rl.stages.base import INNER_SLOTS, MANY_SLOTS, SINGLE_SLOTS, StepStage

OLD_LOG_PROBS = {  # TrainConfig.old_log_probs_source -> how the plan reads it
    "none": "none (preference update)",
    "rollout": "the rollout's",
    "update": "the update's forward",
    "pass": "a pass before the advantages",
}


@dataclass(frozen=True)
class StepPlan:
    """A run's step, stage by stage (slots: :mod:`tandem.rl.stages.base`).

    Attributes:
        collect: how the step's scored prompt groups are collected.
        draws: what each scored draw is given (in order).
        update: the step's update.
        prepares: the policy-gradient batch's preparation, before its data is put anywhere.
        passes: the worker passes whose outputs join the step (over the pairs, for a preference update).
        views: what the controller's batch is given before the advantages.
        old_log_probs: ``TrainConfig.old_log_probs_source``.
    """

    collect: StepStage
    draws: tuple[StepStage, ...]
    update: StepStage
    prepares: tuple[StepStage, ...]
    passes: tuple[StepStage, ...]
    views: tuple[StepStage, ...]
    old_log_probs: str

    def stages(self) -> tuple[StepStage, ...]:
        """Every stage of the plan, in the order the step meets them."""
        return (self.collect, *self.draws, self.update, *self.prepares, *self.passes, *self.views)

    @property
    def takes_stored_draws(self) -> bool:
        """Whether the step can run on draws kept in the data plane (``BatchRef``): only the
        built-in collect and update, with no stage that reads a draw's or the view's tensors
        (``draw``, ``view``); the others rebuild the draw on the controller."""
        return self.collect.default and self.update.default and not self.draws and not self.views

    def names(self) -> dict[str, tuple[str, ...]]:
        """Each slot's stage names."""
        return {
            "collect": (self.collect.name,),
            "draw": tuple(s.name for s in self.draws),
            "update": (self.update.name,),
            "prepare": tuple(s.name for s in self.prepares),
            "pass": tuple(s.name for s in self.passes),
            "view": tuple(s.name for s in self.views),
        }

    def describe(self) -> str:
        """One line: ``step: collect one_draw -> update policy_gradient (pass: reference); old log-probs: ...``."""
        slots = self.names()
        collect = _with(slots["collect"][0], "draw", slots["draw"])
        inner = "; ".join(
            f"{slot}: {', '.join(slots[slot])}" for slot in ("prepare", "pass", "view") if slots[slot]
        )
        update = f"{slots['update'][0]} ({inner})" if inner else slots["update"][0]
        return (
            f"step: collect {collect} -> update {update}; old log-probs: {OLD_LOG_PROBS[self.old_log_probs]}"
        )


def _with(name: str, slot: str, names: tuple[str, ...]) -> str:
    return f"{name} ({slot}: {', '.join(names)})" if names else name


def build_step_plan(config: Any) -> StepPlan:
    """The plan of ``config`` (a :class:`tandem.rl.config.TrainConfig`): every registered stage
    whose ``applies(config)`` holds, in its slot. ``ValueError`` when two stages claim a
    one-stage slot (naming both), or none does and there is no default."""
    applying: dict[str, list[StepStage]] = {slot: [] for slot in (*SINGLE_SLOTS, *MANY_SLOTS)}
    defaults: dict[str, StepStage] = {}
    for stage in registered_stages():
        if stage.default:
            defaults[stage.slot] = stage
        elif stage.applies(config):
            applying[stage.slot].append(stage)
    single = {slot: _single(slot, applying[slot], defaults.get(slot)) for slot in SINGLE_SLOTS}
    many = {slot: tuple(sorted(applying[slot], key=lambda s: (s.order, s.name))) for slot in MANY_SLOTS}
    for slot in INNER_SLOTS:
        if slot not in single["update"].runs:  # its update does not run them (online DPO: no row balance)
            many[slot] = ()
    return StepPlan(
        collect=single["collect"],
        draws=many["draw"],
        update=single["update"],
        prepares=many["prepare"],
        passes=many["pass"],
        views=many["view"],
        old_log_probs=config.old_log_probs_source,
    )


def _single(slot: str, stages: list[StepStage], default: StepStage | None) -> StepStage:
    if len(stages) > 1:
        raise ValueError(
            f"step stages {sorted(s.name for s in stages)} all apply to the {slot} slot of this run's "
            "step, which takes one: change the settings that select them"
        )
    if stages:
        return stages[0]
    if default is None:
        raise ValueError(f"no step stage applies to the {slot} slot and none is its default")
    return default
