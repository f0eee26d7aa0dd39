"""The step's advantages: the KL penalty in the reward (if any), the rollout correction, the
configured estimator and, when distilling, the teacher's per-token signal.

On the controller's ``Batch`` (:func:`step_advantages`), or, when the step's tokens stay in the
data plane, split into per-row work on the ranks and per-row scalars on the controller
(:mod:`tandem.rl.rank_advantages`, :mod:`tandem.rl.ref_advantages`). Both call the per-row pieces
here (:func:`token_rewards`, :func:`final_advantages`) and reduce the same metric terms
(:mod:`tandem.algos.reductions`).
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.algos import AdvantageInput, compute_advantage, compute_rollout_correction
from tandem.algos.distill import distill_metrics_of, distill_terms, distilled_advantages
from tandem.algos.kl import kl_penalty, kl_penalty_metrics
from tandem.algos.reductions import Terms, reduce_whole
from tandem.algos.rollout_correction import correction_metrics
from tandem.protocol import Batch, group_ids_from_uids

# the stage outputs step_advantages reads (ref_log_probs too, with the KL penalty in the reward)
ADVANTAGE_READS = ("old_log_probs", "sum_pi_squared", "values", "teacher_log_probs")
KL_TERMS, CORRECTION_TERMS, DISTILL_TERMS = "kl:", "rollout_corr:", "distill:"  # the terms' prefixes


def advantage_reads(algorithm: Any) -> tuple[str, ...]:
    """The stage outputs :func:`step_advantages` reads under ``algorithm`` (the config's section)."""
    return ADVANTAGE_READS + (("ref_log_probs",) if algorithm.kl.use_kl_in_reward else ())


def rollout_reads(stage_outputs: set[str]) -> tuple[str, ...]:
    """The rollout's per-token fields :func:`step_advantages` reads, the stages having made
    ``stage_outputs``: the response mask, and the rollout log-probs for the rollout correction
    (with old log-probs) or as the student's log-probs (when distilling without them)."""
    needs_log_probs = bool(stage_outputs & {"old_log_probs", "teacher_log_probs"})
    return ("response_mask", *(("rollout_log_probs",) if needs_log_probs else ()))


def token_rewards(
    batch: Batch, scores: torch.Tensor, algorithm: Any, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Terms]:
    """Row by row: the token rewards ``[B, R]`` (``scores [B, R]`` less the KL penalty when it is in
    the reward, at ``kl_coef``), the response mask ``[B, R]`` and importance weights ``[B, R]`` (or
    None) after the rollout correction (with old log-probs), and the terms of their metrics
    (prefixed :data:`KL_TERMS`, :data:`CORRECTION_TERMS`)."""
    terms: Terms = {}
    mask, rewards, weights = batch["response_mask"], scores, None
    if algorithm.kl.use_kl_in_reward:
        rewards, kl_terms = kl_penalty(
            rewards, batch["old_log_probs"], batch["ref_log_probs"], mask, kl_coef, algorithm.kl.estimator
        )
        terms.update({KL_TERMS + k: v for k, v in kl_terms.items()})
    if "old_log_probs" in batch:  # else the update measures the mismatch (on-policy, no correction)
        correction = compute_rollout_correction(
            batch["old_log_probs"], batch["rollout_log_probs"], mask, algorithm.rollout_correction
        )
        terms.update({CORRECTION_TERMS + k: v for k, v in correction.terms.items()})
        mask, weights = correction.response_mask, correction.is_weights
    return rewards, mask, weights, terms


def final_advantages(
    batch: Batch, advantages: torch.Tensor, mask: torch.Tensor, algorithm: Any
) -> tuple[torch.Tensor, Terms]:
    """Row by row: the estimator's ``advantages [B, R]`` with the teacher's per-token signal when
    distilling (``teacher_log_probs`` in ``batch``), and the terms of the distillation metrics."""
    if "teacher_log_probs" not in batch:
        return advantages, {}
    student = batch["old_log_probs"] if "old_log_probs" in batch else batch["rollout_log_probs"]
    teacher = batch["teacher_log_probs"]
    advantages = distilled_advantages(advantages, student, teacher, mask, algorithm.distill)
    return advantages, {DISTILL_TERMS + k: v for k, v in distill_terms(student, teacher, mask).items()}


def advantage_metrics(
    reduced: dict[str, torch.Tensor], kl_coef: float, dtype: torch.dtype
) -> dict[str, float]:
    """The step's advantage metrics from its reduced terms (``actor/reward_*``, ``rollout_corr/*``,
    ``distill/*``), however the rows were reduced."""

    def part(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix) :]: v for k, v in reduced.items() if k.startswith(prefix)}

    metrics: dict[str, float] = {}
    if kl := part(KL_TERMS):
        metrics.update(
            {f"actor/reward_{k}": float(v) for k, v in kl_penalty_metrics(kl, kl_coef, dtype).items()}
        )
    if correction := part(CORRECTION_TERMS):
        metrics.update({k: float(v) for k, v in correction_metrics(correction).items()})
    if distill := part(DISTILL_TERMS):
        metrics.update({k: float(v) for k, v in distill_metrics_of(distill).items()})
    return metrics


def step_advantages(batch: Batch, algorithm: Any, kl_controller: Any) -> tuple[Batch, dict[str, float]]:
    """``batch`` with ``token_level_rewards``, ``advantages [B, R]``, ``response_mask`` (after the
    rollout correction) and, with a critic, ``returns``; and the step's advantage metrics.
    ``kl_controller`` (the adaptive KL coefficient) is updated when the penalty is in the reward."""
    coef = kl_controller.value
    rewards, mask, weights, terms = token_rewards(batch, batch["token_level_scores"], algorithm, coef)
    if algorithm.kl.use_kl_in_reward:
        kl_controller.update(float(reduce_whole({"kl": terms[KL_TERMS + "kl"]})["kl"]), len(batch))
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
    advantages, distill = final_advantages(batch, advantage.advantages, mask, algorithm)
    metrics = advantage_metrics(reduce_whole({**terms, **distill}), coef, rewards.dtype)
    tensors = {"token_level_rewards": rewards, "advantages": advantages, "response_mask": mask}
    if "values" in batch:  # the critic's targets
        tensors["returns"] = advantage.returns
    if weights is not None:
        tensors["rollout_is_weights"] = weights
    return batch.assign(tensors=tensors), metrics
