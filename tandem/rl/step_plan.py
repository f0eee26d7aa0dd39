"""``StepPlan``: the stages one RL step runs, built once from the config and the stage registry.

Every registered stage (:mod:`tandem.rl.stages`, and a plugin's) declares its slot and when it
applies; :func:`build_step_plan` asks each of them, so the trainer never asks which algorithm
runs: ReMax contributes a draw stage, DAPO a collect stage, online DPO an update, distillation
a pass, GKD a pass that wraps the batch source. What the run asks of the step, the stages
declare: where the old log-probs come from, whether the reference runs and a critic trains
(the update's ``old_log_probs=``, ``reference=``, ``critic=``), what a replay cannot run
(``replay=``), which source a step draws from (``batch_source=``); the plan carries the old
log-probs' source. The run prints the plan
(:func:`tandem.rl.plan.run_plan`). The plan is built in :mod:`tandem.rl.stage_registry`, beside
the registry; importing this module registers the built-in stages.
"""

import tandem.rl.stages  # noqa: F401  (the built-in stages' registration)
from tandem.rl.stage_registry import OLD_LOG_PROBS, StepPlan, build_step_plan

__all__ = ["OLD_LOG_PROBS", "StepPlan", "build_step_plan"]
