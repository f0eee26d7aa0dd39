"""Whether a run may stream its draws to the trainer's forward passes (``pipeline.stream_forward``):
the one place that decides, and the chunk size.

Streaming runs the step plan's streaming passes (``StepStage.streams``: old and reference
log-probs, the critic's values) on each chunk of a draw as it arrives, and the step then takes
their joined outputs instead of running those passes on the whole draw
(:mod:`tandem.rl.stream_forward`). That is exact only when the rows the passes would have seen are
the chunks' rows, in the chunks' order, and the chunks' rows are references that the trainer's ranks
read: the draw stays in the replicas' blocks, the step draws once, and nothing reorders or filters
the draw's rows before the passes. :func:`check_stream_forward` refuses the rest, naming the keys;
what a plugin's stage might do to the rows is checked step by step (the joined rows must be the
step's: :meth:`tandem.rl.stream_forward.ForwardStream.outputs_for`).

This module reads the config and the plan only (no stage, no worker), so that the config's rules
can ask it (:meth:`tandem.rl.stage_registry.StepPlan.check`).
"""

from __future__ import annotations

import math
from typing import Any

REORDERING_PREPARES = {  # prepare stages that reorder or filter the rows, and the setting that adds them
    "balance": "trainer.balance_batch=true with more than one actor data-parallel rank (set trainer.balance_batch=false)",
}


def check_stream_forward(config: Any, plan: Any) -> None:
    """``ValueError`` naming the keys when ``config`` (a :class:`tandem.rl.config.TrainConfig` with
    ``pipeline.stream_forward``) and its ``plan`` cannot stream (see the module docstring)."""
    for reason in stream_refusals(config, plan):
        raise ValueError(f"pipeline.stream_forward=true: {reason}")


def stream_refusals(config: Any, plan: Any) -> list[str]:
    """Why ``config``'s ``plan`` cannot stream its draws to the passes (empty: it can)."""
    reasons = []
    if not config.dataplane.enabled:
        reasons.append("the chunks are references into the replicas' blocks; set dataplane.enabled=true")
    if plan.update.name != "policy_gradient":
        reasons.append(
            f"the step's update {plan.update.name!r} runs its passes over other rows than the draw's"
        )
    if plan.collect.name != "one_draw":
        reasons.append(
            f"the step's collect stage {plan.collect.name!r} chooses the step's rows from its draws "
            "(algorithm.filter_groups.enable: set it false)"
        )
    for stage in plan.prepares:
        if stage.name in REORDERING_PREPARES:
            reasons.append(
                f"the prepare stage {stage.name!r} reorders the draw's rows: {REORDERING_PREPARES[stage.name]}"
            )
    if not plan.takes_stored_draws:
        rebuilt = [s.name for s in plan.stages() if not s.stored]
        reasons.append(
            f"the stages {rebuilt} rebuild the draw on the controller, so it is not kept in the replicas' blocks"
        )
    if not plan.streamed_passes:
        reasons.append(
            f"the step has no pass that streams (its passes: {[s.name for s in plan.passes]}; old log-probs "
            f"from {plan.old_log_probs}): nothing to run before the draw is complete"
        )
    return reasons


def chunk_groups(config: Any) -> int:
    """Prompt groups per chunk: ``pipeline.stream_forward_groups``, or (0) the fewest whose rows
    make one micro-batch on each actor rank (``actor.engine.micro_batch_size`` rows, or with packing
    as many of the longest sequences as ``max_tokens_per_micro_batch`` holds) and divide evenly
    over the ranks; at most the step's groups."""
    groups_per_step = config.data.train_batch_size
    if config.pipeline.stream_forward_groups:
        return min(config.pipeline.stream_forward_groups, groups_per_step)
    engine, n, ranks = config.actor.engine, config.rollout.n, config.actor_dp_size
    longest = config.data.max_prompt_length + config.rollout.max_response_length
    per_rank = (
        max(1, engine.max_tokens_per_micro_batch // longest)
        if engine.use_packing
        else engine.micro_batch_size
    )
    groups = math.ceil(ranks * per_rank / n)
    while (groups * n) % ranks and groups < groups_per_step:
        groups += 1
    return min(groups, groups_per_step)
