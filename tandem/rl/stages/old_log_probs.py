"""PPO's old log-probs, from where ``TrainConfig.old_log_probs_source`` (the one place that
decides it) says: the rollout's own (``rollout``: renamed before the step's data is put), a pass
of the actor before the advantages (``pass``), or the update's forward (``update``: the worker's
loss detaches it, no stage runs). Online DPO has none (``none``)."""

from __future__ import annotations

from typing import Any

from tandem.protocol import Batch
from tandem.rl.dataset_responses import OFF_POLICY
from tandem.rl.metrics import timed
from tandem.rl.stages.base import register_step_stage


def is_dataset_step(batch: Any) -> bool:
    """Whether the step's responses are the dataset's (GKD), not sampled: no rollout log-probs."""
    return OFF_POLICY in batch and bool(batch[OFF_POLICY][0])


@register_step_stage(
    "rollout_old_log_probs",
    "prepare",
    applies=lambda config: config.old_log_probs_source == "rollout",
    order=20,
    stored=False,  # it renames a field the rollout stored
)
def rollout_old_log_probs(trainer: Any, batch: Batch) -> Batch:
    """``old_log_probs``: the rollout's log-probs of the sampled tokens (the behaviour policy's)."""
    return batch.assign(tensors={"old_log_probs": batch["rollout_log_probs"]})


@register_step_stage(
    "old_log_probs", "pass", applies=lambda config: config.old_log_probs_source == "pass", order=10
)
def old_log_probs(trainer: Any, data: Any, timings: dict[str, float]) -> None:
    """``old_log_probs``: the actor's log-probs of the step's tokens, before any update."""
    with timed(timings, "old_log_prob"):
        data.stage(trainer.workers, trainer.workers.compute_log_prob)
