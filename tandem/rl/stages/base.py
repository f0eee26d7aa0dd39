"""``StepStage``: one named piece of the RL step, where in the step it runs and when; and the
registry of them (``STEP_STAGES``, :func:`register_step_stage`) that built-in algorithms and user
plugins fill alike.

A step runs its stages in slots, in this order (``trainer`` is the :class:`tandem.rl.RLTrainer`;
``timings`` its step's ``{name: seconds}``):

======== ========== =======================================================================
slot     how many   ``run`` signature, and what it does
======== ========== =======================================================================
collect  exactly 1  ``(trainer, timings) -> (Batch, metrics)``: the step's scored prompt
                    groups, from ``trainer.scored_draw`` calls (one draw, or DAPO's draws)
draw     any        ``(trainer, scored, timings) -> Batch``: each scored draw, extended
                    (ReMax's greedy baselines)
update   exactly 1  ``(trainer, batch, timings) -> (Batch, metrics)``: the update (policy
                    gradient, or online DPO's preference step)
prepare  any        ``(trainer, batch) -> Batch``: the policy-gradient step's batch, before
                    its data is put anywhere (row balance, old log-probs from the rollout)
pass     any        ``(trainer, data, timings) -> None``: a worker pass whose outputs join the
                    step (``data.stage(group, method)``; :mod:`tandem.rl.step_data`): old,
                    reference and teacher log-probs, the critic's values
view     any        ``(trainer, view) -> Batch``: the controller's batch, before advantages
======== ========== =======================================================================

``applies(config)`` (the :class:`tandem.rl.config.TrainConfig`) says whether the stage runs in a
run; :func:`tandem.rl.step_plan.build_step_plan` asks every registered stage. Of the one-stage
slots, a stage declared ``default=True`` runs when no other applies; two others applying is an
error naming both. The many-stage slots run in ``order`` (then name); of ``prepare``, ``pass``
and ``view``, only those the update declares it runs (``runs=``: the policy-gradient update all
three, the preference update ``pass``, over its pairs). ``check(trainer)``, when
given, runs once when the trainer is built, before any worker starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.registry import Registry

SINGLE_SLOTS = ("collect", "update")  # exactly one stage each
MANY_SLOTS = ("draw", "prepare", "pass", "view")  # any number each, in order
INNER_SLOTS = ("prepare", "pass", "view")  # run by the update that declares them (runs=)
SLOTS = (*SINGLE_SLOTS, *MANY_SLOTS)


@dataclass(frozen=True)
class StepStage:
    """A registered stage (see the module docstring); calling it calls ``run``.

    Attributes:
        name: its registered name (the plan prints it).
        slot: where in the step it runs (``SLOTS``).
        applies: ``config -> bool``: whether it runs in a run.
        run: what it does (the slot's signature).
        order: its place among its slot's stages (built-ins use 10-40; plugins default to 100).
        default: a one-stage slot's stage when no other applies.
        check: ``trainer -> None``, run when the trainer is built (a bad setting is named then).
        runs: an update's inner slots, those it runs (of ``prepare``, ``pass``, ``view``); the
            plan leaves out the others' stages.
    """

    name: str
    slot: str
    applies: Callable[[Any], bool]
    run: Callable[..., Any]
    order: int = 100
    default: bool = False
    check: Callable[[Any], None] | None = None
    runs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.slot not in SLOTS:
            raise ValueError(f"step stage {self.name!r}: slot={self.slot!r}; choose one of {list(SLOTS)}")
        if self.default and self.slot not in SINGLE_SLOTS:
            raise ValueError(f"step stage {self.name!r}: default=True is for the slots {list(SINGLE_SLOTS)}")
        if not set(self.runs) <= set(INNER_SLOTS) or (self.runs and self.slot != "update"):
            raise ValueError(
                f"step stage {self.name!r}: runs={self.runs!r} names an update's slots, of {list(INNER_SLOTS)}"
            )
        object.__setattr__(self, "__module__", self.run.__module__)  # where it came from (tandem algos)
        object.__setattr__(self, "__doc__", self.run.__doc__)

    def __call__(self, *args: Any) -> Any:
        return self.run(*args)


STEP_STAGES: Registry[StepStage] = Registry("step stage")


def register_step_stage(
    name: str,
    slot: str,
    applies: Callable[[Any], bool],
    order: int = 100,
    default: bool = False,
    check: Callable[[Any], None] | None = None,
    runs: tuple[str, ...] = (),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register the function as step stage ``name`` in ``slot`` (see the module
    docstring), running when ``applies(config)``; a name registered twice raises."""

    def decorator(run: Callable[..., Any]) -> Callable[..., Any]:
        stage = StepStage(name, slot, applies, run, order, default, check, runs)
        STEP_STAGES.register(name)(stage)
        return run

    return decorator


def registered_stages() -> list[StepStage]:
    """Every registered stage."""
    return [STEP_STAGES.get(name) for name in STEP_STAGES.names()]
