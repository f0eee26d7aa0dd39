"""The run's plan as the trainer prints it before the first step: algorithm, model, workers,
engine, pipeline, data, schedule, and the step's stages (:class:`tandem.rl.step_plan.StepPlan`)."""

from __future__ import annotations

from typing import Any

from tandem.rl.config import TrainConfig
from tandem.rl.step_plan import StepPlan


def run_plan(
    config: TrainConfig,
    step_plan: StepPlan,
    params: int,
    train_data: Any,
    val_prompts: int,
    total_steps: int,
    step: int,
) -> str:
    """Four lines: what trains where, on which prompts, for how many steps from ``step``, and the
    stages of each step."""
    data, n = config.data, config.rollout.n
    return (
        f"[bold]RL[/] {config.algorithm.adv_estimator} + {config.actor.policy_loss.name} loss, "
        f"policy {params / 1e6:.2f}M parameters, {config.world_size} worker(s) on {config.trainer.backend} "
        f"(device {config.trainer.device}), {config.rollout.engine.name} rollout engine"
        f"{pipeline_plan(config)}\n"
        f"  {len(train_data)} training prompts ({train_data.filtered} over {data.max_prompt_length} tokens "
        f"filtered), {val_prompts} validation prompts\n"
        f"  {total_steps} steps of {data.train_batch_size} prompts x {n} responses; "
        f"{data.train_batch_size // config.mini_batch_prompts} optimizer step(s) x {config.actor.ppo_epochs} "
        f"epoch(s) per step; starting at step {step}\n"
        f"  {step_plan.describe()}"
    )


def pipeline_plan(config: TrainConfig) -> str:
    """Where generation runs and how it overlaps training."""
    pipeline = config.pipeline
    if not pipeline.disaggregated:
        return ", colocated (pipeline.mode=sync)"
    nodes = f" over {pipeline.rollout_nodes} nodes" if pipeline.rollout_nodes > 1 else ""
    plan = f", {pipeline.rollout_replicas} rollout replica(s){nodes}, pipeline.mode={pipeline.mode}"
    if pipeline.mode == "fully_async":
        plan += (
            f" (staleness_threshold {pipeline.staleness_threshold}, partial_rollout "
            f"{pipeline.partial_rollout}, sync every {pipeline.trigger_parameter_sync_step} step(s))"
        )
    return plan + f", weights by {pipeline.checkpoint_engine.backend}"
