"""Online DPO (``actor.objective=preference``): each prompt's best- and worst-scored responses form
a pair, the plan's passes run over the pairs (the reference's log-probs, when the loss compares to
it), and the actor takes one preference-loss step."""

from __future__ import annotations

from typing import Any

from tandem.protocol import Batch
from tandem.rl.metrics import timed
from tandem.rl.preference_pairs import best_worst_pairs, with_reference_sums
from tandem.rl.stages.base import register_step_stage
from tandem.rl.step_data import BatchStep


@register_step_stage("preference", "update", applies=lambda config: config.prefers, runs=("pass",))
def preference(trainer: Any, batch: Batch, timings: dict[str, float]) -> tuple[Batch, dict[str, float]]:
    """The pairs' preference update; returns the whole scored batch (for its statistics)."""
    config = trainer.config
    batch = batch.assign(tensors={"token_level_rewards": batch["token_level_scores"]})  # no KL in the reward
    with timed(timings, "adv"):
        pairs, metrics = best_worst_pairs(batch, config.rollout.n, config.actor_dp_size)
    if pairs is None:  # no prompt scored its responses differently: nothing to prefer
        trainer.console.print(
            f"[yellow]step {trainer.step}: no prompt group has a preference; update skipped"
        )
        return batch, metrics
    data = BatchStep(pairs)
    for stage in trainer.plan.passes:
        stage(trainer, data, timings)
    pairs = with_reference_sums(data.batch) if "ref_log_probs" in data.batch else data.batch
    with timed(timings, "update_actor"):
        metrics.update(trainer.update_actor(pairs))
    return batch, metrics
