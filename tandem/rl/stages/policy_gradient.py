"""The policy-gradient update (the default): the plan's prepare stages, its passes over the step's
data, its view stages, the advantages, then the critic's and the actor's updates
(``RLTrainer._policy_gradient_update``, the hook a subclass wraps); and the row balance that
prepares its batch (``trainer.balance_batch``). It declares where its old log-probs come from
(:func:`tandem.rl.stages.old_log_probs.policy_gradient_old_log_probs`), that it reads the
reference for a KL term and trains a critic when the advantage estimator reads values."""

from __future__ import annotations

from typing import Any

from tandem.protocol import Batch
from tandem.protocol.sequences import sequence_lengths
from tandem.rl.balance import balanced_order
from tandem.rl.stages.base import register_step_stage
from tandem.rl.stages.old_log_probs import policy_gradient_old_log_probs


@register_step_stage(
    "policy_gradient",
    "update",
    applies=lambda config: False,
    default=True,
    runs=("prepare", "pass", "view"),
    stored=True,
    old_log_probs=policy_gradient_old_log_probs,
    reference=lambda config: config.algorithm.needs_reference,  # a KL term
    critic=lambda config: config.algorithm.needs_values,  # the advantage estimator reads values
)
def policy_gradient(trainer: Any, batch: Batch, timings: dict[str, float]) -> tuple[Batch, dict[str, float]]:
    """Old, reference and teacher log-probs and values, advantages, then the PPO-style update."""
    return trainer._policy_gradient_update(batch, timings)


@register_step_stage(
    "balance",
    "prepare",
    applies=lambda config: config.trainer.balance_batch and config.actor_dp_size > 1,
    order=10,
)
def balance(trainer: Any, batch: Batch) -> Batch:
    """The rows reordered so that every data-parallel rank gets about as many tokens
    (:func:`tandem.rl.balance.balanced_order`)."""
    config = trainer.config
    order = balanced_order(sequence_lengths(batch).tolist(), config.rollout.n, config.actor_dp_size)
    return batch.reorder(order)
