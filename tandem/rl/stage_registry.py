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
given, runs once when the trainer is built, before any worker starts; ``rule(config, plan)``, when
given, when the config is validated (:func:`tandem.rl.config.rules.check_train_config`, in the
stage's plan): a bad setting or combination is named before any file is read.

What the rest of the run asks a plan, its stages declare (never an algorithm's flag):

* the update: ``old_log_probs(config)``, where its old log-probs come from (``OLD_LOG_PROBS``;
  undeclared: ``none``), ``reference(config)``, whether it reads the reference's log-probs, and
  ``critic(config)``, whether a critic trains beside it (undeclared: no);
* any stage: ``replay(config)``, why a replay of a recorded run (``pipeline.replay``, which runs no
  rollout engine) cannot run it, and ``batch_source(config, source, inputs)``, the run's batch
  source wrapped with the stage's (GKD's dataset steps: :mod:`tandem.rl.batch_source`).

``stored`` says whether the stage takes a draw kept in the data plane (a ``BatchRef``,
:mod:`tandem.rl.step_data`): a run's draws stay stored only when every stage of its plan does
(:attr:`tandem.rl.step_plan.StepPlan.takes_stored_draws`). Unless told, a ``prepare`` or ``pass``
stage does (its ``batch`` may be a ``BatchRef``; a pass reaches the data through ``data.stage``)
and a stage of another slot does not (it may read the draw's tensors).

``streams`` says whether a ``pass`` stage may run on a draw's chunks as they arrive
(``pipeline.stream_forward``: :mod:`tandem.rl.stream_forward`): a forward-only pass whose outputs
for a row depend on that row alone, reached through ``data.stage`` without ``joined``.

The stages themselves are registered by the modules of :mod:`tandem.rl.stages`, imported by
:mod:`tandem.rl.step_plan` (which re-exports :class:`StepPlan` and :func:`build_step_plan`). This
module holds the registry and the plan built from it, and imports no stage, so that the config's
rules (:mod:`tandem.rl.config.rules`) can ask the plan: the stages read the config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.registry import Registry
from tandem.rl.stream_plan import check_stream_forward

SINGLE_SLOTS = ("collect", "update")  # exactly one stage each
MANY_SLOTS = ("draw", "prepare", "pass", "view")  # any number each, in order
INNER_SLOTS = ("prepare", "pass", "view")  # run by the update that declares them (runs=)
SLOTS = (*SINGLE_SLOTS, *MANY_SLOTS)
STORED_BY_DEFAULT = ("prepare", "pass")  # slots whose stages take stored draws unless told (stored=)
UPDATE_DECLARATIONS = ("old_log_probs", "reference", "critic")  # what only an update declares


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
        stored: whether it takes draws kept in the data plane (``None``: its slot's default).
        rule: ``(config, plan) -> None``, run when the config is validated.
        old_log_probs: an update's ``config -> str``: where its old log-probs come from (``OLD_LOG_PROBS``).
        reference: an update's ``config -> bool``: whether it reads the reference's log-probs.
        critic: an update's ``config -> bool``: whether a critic trains beside it.
        replay: ``config -> str``: why ``pipeline.replay`` cannot run the stage (``None``: it can).
        batch_source: ``(config, source, inputs) -> BatchSource``: the run's source, wrapped.
        streams: a pass that may run on a draw's chunks as they arrive (``pipeline.stream_forward``).
    """

    name: str
    slot: str
    applies: Callable[[Any], bool]
    run: Callable[..., Any]
    order: int = 100
    default: bool = False
    check: Callable[[Any], None] | None = None
    runs: tuple[str, ...] = ()
    stored: bool | None = None
    rule: Callable[[Any, Any], None] | None = None
    old_log_probs: Callable[[Any], str] | None = None
    reference: Callable[[Any], bool] | None = None
    critic: Callable[[Any], bool] | None = None
    replay: Callable[[Any], str] | None = None
    batch_source: Callable[[Any, Any, Any], Any] | None = None
    streams: bool = False

    def __post_init__(self) -> None:
        if self.slot not in SLOTS:
            raise ValueError(f"step stage {self.name!r}: slot={self.slot!r}; choose one of {list(SLOTS)}")
        if self.default and self.slot not in SINGLE_SLOTS:
            raise ValueError(f"step stage {self.name!r}: default=True is for the slots {list(SINGLE_SLOTS)}")
        if not set(self.runs) <= set(INNER_SLOTS) or (self.runs and self.slot != "update"):
            raise ValueError(
                f"step stage {self.name!r}: runs={self.runs!r} names an update's slots, of {list(INNER_SLOTS)}"
            )
        declared = [k for k in UPDATE_DECLARATIONS if getattr(self, k) is not None]
        if declared and self.slot != "update":
            raise ValueError(
                f"step stage {self.name!r}: {'=, '.join(declared)}= are an update's declarations"
            )
        if self.streams and self.slot != "pass":
            raise ValueError(f"step stage {self.name!r}: streams=True is for the pass slot")
        if self.stored is None:
            object.__setattr__(self, "stored", self.slot in STORED_BY_DEFAULT)
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
    stored: bool | None = None,
    rule: Callable[[Any, Any], None] | None = None,
    streams: bool = False,
    **declarations: Callable[..., Any],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register the function as step stage ``name`` in ``slot`` (see the module
    docstring), running when ``applies(config)``; ``declarations``: ``old_log_probs``,
    ``reference``, ``critic`` (an update's), ``replay``, ``batch_source``. A name registered twice
    raises."""

    def decorator(run: Callable[..., Any]) -> Callable[..., Any]:
        stage = StepStage(
            name, slot, applies, run, order, default, check, runs, stored, rule, streams=streams,
            **declarations,
        )  # fmt: skip
        STEP_STAGES.register(name)(stage)
        return run

    return decorator


def registered_stages() -> list[StepStage]:
    """Every registered stage."""
    return [STEP_STAGES.get(name) for name in STEP_STAGES.names()]


# ------------------------------------------------------------------ the plan
OLD_LOG_PROBS = {  # an update's old_log_probs(config) -> how the plan reads it
    "none": "none (preference update)",
    "rollout": "the rollout's",
    "update": "the update's forward",
    "pass": "a pass before the advantages",
}


def update_stage(config: Any) -> StepStage:
    """The update stage of ``config``'s step (the one applying, or the default)."""
    applying = [s for s in registered_stages() if s.slot == "update" and not s.default and s.applies(config)]
    default = next((s for s in registered_stages() if s.slot == "update" and s.default), None)
    return _single("update", applying, default)


def old_log_probs_source(config: Any) -> str:
    """Where ``config``'s old log-probs come from — the one place that decides it: the update's
    declaration (``StepStage.old_log_probs``; ``none`` when it declares none)."""
    declared = update_stage(config).old_log_probs
    source = declared(config) if declared is not None else "none"
    if source not in OLD_LOG_PROBS:
        raise ValueError(f"an update's old log-probs come from one of {list(OLD_LOG_PROBS)}, not {source!r}")
    return source


def needs_reference(config: Any) -> bool:
    """Whether ``config``'s update reads the reference's log-probs (``StepStage.reference``)."""
    declared = update_stage(config).reference
    return bool(declared is not None and declared(config))


def uses_critic(config: Any) -> bool:
    """Whether a critic trains beside ``config``'s update (``StepStage.critic``)."""
    declared = update_stage(config).critic
    return bool(declared is not None and declared(config))


@dataclass(frozen=True)
class StepPlan:
    """A run's step, stage by stage (slots: the module docstring).

    Attributes:
        collect: how the step's scored prompt groups are collected.
        draws: what each scored draw is given (in order).
        update: the step's update.
        prepares: the policy-gradient batch's preparation, before its data is put anywhere.
        passes: the worker passes whose outputs join the step (over the pairs, for a preference update).
        views: what the controller's batch is given before the advantages.
        old_log_probs: where the old log-probs come from (:func:`old_log_probs_source`).
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
        """Whether the step can run on draws kept in the data plane (``BatchRef``): every stage
        declares it does (``StepStage.stored``); otherwise the draw is built on the controller."""
        return all(stage.stored for stage in self.stages())

    @property
    def streamed_passes(self) -> tuple[StepStage, ...]:
        """The passes that may run on a draw's chunks as they arrive (``StepStage.streams``)."""
        return tuple(stage for stage in self.passes if stage.streams)

    def replay_refusals(self, config: Any) -> list[str]:
        """Why a replay (``pipeline.replay``) cannot run this plan: each stage's ``replay`` reason."""
        return [stage.replay(config) for stage in self.stages() if stage.replay is not None]

    def batch_source(self, config: Any, source: Any, inputs: Any) -> Any:
        """The run's batch ``source`` as the plan's stages make it (``StepStage.batch_source``, in
        the plan's order): the source each step draws from."""
        for stage in self.stages():
            if stage.batch_source is not None:
                source = stage.batch_source(config, source, inputs)
        return source

    def check(self, config: Any) -> None:
        """Every stage's config rule (``StepStage.rule``), in the plan's order."""
        for stage in self.stages():
            if stage.rule is not None:
                stage.rule(config, self)
        if config.pipeline.stream_forward:
            check_stream_forward(config, self)

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
        old_log_probs=old_log_probs_source(config),
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
