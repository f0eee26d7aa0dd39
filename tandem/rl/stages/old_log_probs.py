"""PPO's old log-probs, from where the step's update declares (``StepStage.old_log_probs``, read by
:func:`tandem.rl.stage_registry.old_log_probs_source`, the one place that asks): the rollout's own
(``rollout``: renamed before the step's data is put, or given a second name where the draw is
stored), a pass of the actor before the advantages (``pass``), or the update's forward (``update``:
the worker's loss detaches it, no stage runs).
The policy-gradient update's choice is :func:`policy_gradient_old_log_probs`; online DPO has none
(``none``)."""

from __future__ import annotations

from typing import Any

from tandem.dataplane import BatchRef
from tandem.protocol import Batch
from tandem.rl.metrics import timed
from tandem.rl.stage_registry import old_log_probs_source
from tandem.rl.stages.base import register_step_stage


def policy_gradient_old_log_probs(config: Any) -> str:
    """Where the policy-gradient update's old log-probs come from:

    * ``rollout``: an asynchronous pipeline's rollout log-probs (``pipeline.old_log_probs=rollout``);
    * ``update``: the update's own forward, detached, when the step is purely on-policy (never
      when the advantage estimator reads them, since it runs before the update);
    * ``pass``: a forward pass of the actor before the advantages, otherwise.

    GKD's dataset steps make them with a pass whatever this says (:mod:`tandem.rl.stages.dataset_steps`).
    """
    if config.pipeline.disaggregated:  # replicas lag the trainer: the rollout's, or recomputed
        return "rollout" if config.pipeline.old_log_probs == "rollout" else "pass"
    algorithm, actor = config.algorithm, config.actor
    correction = algorithm.rollout_correction
    on_policy = (
        not algorithm.advantages_need_old_log_probs
        and not actor.recompute_old_log_probs
        and actor.ppo_epochs == 1
        and config.mini_batch_prompts == config.data.train_batch_size
        and not algorithm.kl.use_kl_in_reward
        and correction.is_level == "none"
        and correction.rejection == "none"
        and correction.veto_threshold is None
    )
    return "update" if on_policy else "pass"


@register_step_stage(
    "rollout_old_log_probs",
    "prepare",
    applies=lambda config: old_log_probs_source(config) == "rollout",
    order=20,
    stored=True,  # a stored draw's field gets a second name: no payload moves
)
def rollout_old_log_probs(trainer: Any, batch: Batch | BatchRef) -> Batch | BatchRef:
    """``old_log_probs``: the rollout's log-probs of the sampled tokens (the behaviour policy's);
    of a stored draw, the stored ``rollout_log_probs`` under a second name (``BatchRef.alias``:
    the ranks fetch it once, under both names)."""
    if isinstance(batch, BatchRef):
        return batch.alias({"old_log_probs": "rollout_log_probs"})
    return batch.assign(tensors={"old_log_probs": batch["rollout_log_probs"]})


@register_step_stage(
    "old_log_probs",
    "pass",
    applies=lambda config: old_log_probs_source(config) == "pass",
    order=10,
    streams=True,  # each row's log-probs read that row alone: it may run on a draw's chunks
)
def old_log_probs(trainer: Any, data: Any, timings: dict[str, float]) -> None:
    """``old_log_probs``: the actor's log-probs of the step's tokens, before any update."""
    with timed(timings, "old_log_prob"):
        data.stage(trainer.workers, trainer.workers.compute_log_prob)
