"""The RL step's stages: each algorithm that changes the step's shape is one module here that
registers its stages (:mod:`tandem.rl.stages.base`), and :func:`tandem.rl.step_plan.build_step_plan`
picks those a run's config applies. A plugin file registers its own the same way
(``register_step_stage``; docs/extending.md)."""

from tandem.rl.stages import (  # noqa: F401  (registration)
    collect,
    critic,
    dataset_steps,
    distillation,
    dynamic_sampling,
    greedy_baseline,
    old_log_probs,
    policy_gradient,
    preference,
    reference,
)
from tandem.rl.stages.base import SLOTS, STEP_STAGES, StepStage, register_step_stage, registered_stages

__all__ = ["SLOTS", "STEP_STAGES", "StepStage", "register_step_stage", "registered_stages"]
