"""The step's advantages on the controller: the KL penalty in the reward (if any), the rollout
correction, the configured estimator and, when distilling, the teacher's per-token signal."""

from __future__ import annotations

from typing import Any

from tandem.algos import AdvantageInput, apply_kl_penalty, compute_advantage, compute_rollout_correction
from tandem.algos.distill import distill_metrics, distilled_advantages
from tandem.protocol import Batch, group_ids_from_uids

# the stage outputs step_advantages reads (ref_log_probs too, with the KL penalty in the reward)
ADVANTAGE_READS = ("old_log_probs", "sum_pi_squared", "values", "teacher_log_probs")


def advantage_reads(algorithm: Any) -> tuple[str, ...]:
    """The stage outputs :func:`step_advantages` reads under ``algorithm`` (the config's section)."""
    return ADVANTAGE_READS + (("ref_log_probs",) if algorithm.kl.use_kl_in_reward else ())


def rollout_reads(stage_outputs: set[str]) -> tuple[str, ...]:
    """The rollout's per-token fields :func:`step_advantages` reads, the stages having made
    ``stage_outputs``: the response mask, and the rollout log-probs for the rollout correction
    (with old log-probs) or as the student's log-probs (when distilling without them)."""
    needs_log_probs = bool(stage_outputs & {"old_log_probs", "teacher_log_probs"})
    return ("response_mask", *(("rollout_log_probs",) if needs_log_probs else ()))


def step_advantages(batch: Batch, algorithm: Any, kl_controller: Any) -> tuple[Batch, dict[str, float]]:
    """``batch`` with ``token_level_rewards``, ``advantages [B, R]``, ``response_mask`` (after the
    rollout correction) and, with a critic, ``returns``; and the step's advantage metrics.
    ``kl_controller`` (the adaptive KL coefficient) is updated when the penalty is in the reward."""
    metrics: dict[str, float] = {}
    mask = batch["response_mask"]
    rewards = batch["token_level_scores"]
    if algorithm.kl.use_kl_in_reward:
        rewards, kl_metrics = apply_kl_penalty(
            rewards, batch["old_log_probs"], batch["ref_log_probs"], mask,
            kl_controller.value, algorithm.kl.estimator,
        )  # fmt: skip
        kl_controller.update(float(kl_metrics["kl"]), len(batch))
        metrics.update({f"actor/reward_{k}": float(v) for k, v in kl_metrics.items()})
    weights = None
    if "old_log_probs" in batch:  # else the update measures the mismatch (on-policy, no correction)
        correction = compute_rollout_correction(
            batch["old_log_probs"], batch["rollout_log_probs"], mask, algorithm.rollout_correction
        )
        metrics.update({k: float(v) for k, v in correction.metrics.items()})
        mask, weights = correction.response_mask, correction.is_weights
    advantage = compute_advantage(
        AdvantageInput(
            rewards,
            mask,
            group_ids_from_uids(batch["uid"]),
            reward_baselines=batch.get("reward_baselines"),
            reward_components=batch.get("reward_components"),
            old_log_probs=batch.get("old_log_probs"),
            sum_pi_squared=batch.get("sum_pi_squared"),
            rollout_is_weights=weights,
            values=batch.get("values"),
        ),
        algorithm.advantage_config(),
    )
    advantages = advantage.advantages
    if "teacher_log_probs" in batch:  # on-policy distillation: the teacher's per-token signal
        student = batch["old_log_probs"] if "old_log_probs" in batch else batch["rollout_log_probs"]
        advantages = distilled_advantages(
            advantages, student, batch["teacher_log_probs"], mask, algorithm.distill
        )
        metrics.update(
            {k: float(v) for k, v in distill_metrics(student, batch["teacher_log_probs"], mask).items()}
        )
    tensors = {"token_level_rewards": rewards, "advantages": advantages, "response_mask": mask}
    if "values" in batch:  # the critic's targets
        tensors["returns"] = advantage.returns
    if weights is not None:
        tensors["rollout_is_weights"] = weights
    return batch.assign(tensors=tensors), metrics
