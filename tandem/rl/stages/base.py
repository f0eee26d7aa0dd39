"""The step stages' registry and slots, for the stage modules: they live in
:mod:`tandem.rl.stage_registry` (outside this package, so that the config's rules can build the
step plan without importing the stages); see its docstring for the slots and what a stage declares."""

from tandem.rl.stage_registry import (
    INNER_SLOTS,
    MANY_SLOTS,
    SINGLE_SLOTS,
    SLOTS,
    STEP_STAGES,
    STORED_BY_DEFAULT,
    StepStage,
    register_step_stage,
    registered_stages,
)

__all__ = [
    "INNER_SLOTS",
    "MANY_SLOTS",
    "SINGLE_SLOTS",
    "SLOTS",
    "STEP_STAGES",
    "STORED_BY_DEFAULT",
    "StepStage",
    "register_step_stage",
    "registered_stages",
]
