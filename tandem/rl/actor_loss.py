"""The actor's loss for one micro-batch: policy loss, optional entropy bonus, reference-KL term and
distillation term.

Built as a closure the training engine calls with ``(micro_batch, token_outputs)``; it returns
this micro-batch's share of the mini-batch loss (global token/sequence counts in the
normalizer) and its metrics, named as verl names them (``actor/pg_loss``, ...), each a share of
the mini-batch's value too (:mod:`tandem.rl.metric_shares`): the reduction adds them up.
"""

from __future__ import annotations

import torch

from tandem.algos import (
    KLConfig,
    LossNormalizer,
    PolicyLossConfig,
    PolicyLossInput,
    aggregate_loss,
    compute_kl_loss,
    compute_policy_loss,
    mismatch_metrics,
)
from tandem.algos.distill import DISTILL_LOSSES, DistillConfig
from tandem.algos.masked import masked_mean
from tandem.engine.base import LossFn, TokenOutputs
from tandem.protocol import Batch
from tandem.protocol.sequences import response_part
from tandem.rl.metric_shares import as_shares

METRIC_NAMES = {"pg_clipfrac": "actor/pg_clipfrac", "ppo_kl": "actor/ppo_kl"}
LOSS_SHARES = ("actor/pg_loss", "actor/kl_loss", "distill/loss")  # divided by the normalizer already


def make_actor_loss(
    loss_config: PolicyLossConfig,
    normalizer: LossNormalizer,
    entropy_coeff: float = 0.0,
    kl: KLConfig | None = None,
    old_from_current: bool = False,
    distill: DistillConfig | None = None,
) -> LossFn:
    """A loss function for :meth:`TorchTrainEngine.forward_backward` (see the module docstring).

    The micro-batch needs ``prompts [B, P]``, ``response_mask``, ``old_log_probs`` and
    ``advantages`` (``[B, R]``), plus ``rollout_is_weights`` when rollout correction is on and
    ``ref_log_probs`` when ``kl.use_kl_loss``. With ``old_from_current`` (a purely on-policy
    step) ``old_log_probs`` are this forward's own log-probs, detached, and the micro-batch
    needs ``rollout_log_probs`` instead: the rollout-vs-trainer mismatch is measured here.
    With the teacher's top-k tokens in the micro-batch (``teacher_top_ids``, ``teacher_top_log_probs``
    ``[B, R, k]``; the outputs then hold the student's log-probs of them and its greedy token) the
    greedy agreement is measured, and ``distill``'s loss-term objective is added with weight
    ``distill.coef``.
    """
    use_kl_loss = kl is not None and kl.use_kl_loss

    def loss_fn(micro: Batch, outputs: TokenOutputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        width = micro["prompts"].shape[1]
        log_probs = response_part(outputs.log_probs, width)
        entropy = response_part(outputs.entropy, width)
        mask = micro["response_mask"]
        weights = micro.get("rollout_is_weights")
        old = log_probs.detach() if old_from_current else micro["old_log_probs"]
        result = compute_policy_loss(
            PolicyLossInput(log_probs, old, micro["advantages"], mask, weights, normalizer), loss_config
        )
        loss = result.loss
        metrics = {METRIC_NAMES.get(k, f"actor/{k}"): v.detach() for k, v in result.metrics.items()}
        if old_from_current:
            metrics.update(mismatch_metrics(old, micro["rollout_log_probs"], mask.to(old.dtype)))
        metrics["actor/pg_loss"] = result.loss.detach()
        metrics["actor/entropy"] = masked_mean(entropy.detach(), mask.to(entropy.dtype))
        if entropy_coeff:
            loss = loss - entropy_coeff * aggregate_loss(entropy, mask, loss_config.loss_agg_mode, normalizer)
        if use_kl_loss:
            kl_loss = compute_kl_loss(
                log_probs, micro["ref_log_probs"], mask, kl.estimator, loss_config.loss_agg_mode, normalizer
            )
            loss = loss + kl.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        if "teacher_top_ids" in micro:
            loss = loss + _teacher_top_k_terms(
                micro, outputs, width, mask, distill, loss_config, normalizer, metrics
            )
        return loss, as_shares(metrics, mask, normalizer, LOSS_SHARES)

    return loss_fn


def _teacher_top_k_terms(
    micro: Batch,
    outputs: TokenOutputs,
    width: int,
    mask: torch.Tensor,
    distill: DistillConfig | None,
    loss_config: PolicyLossConfig,
    normalizer: LossNormalizer,
    metrics: dict[str, torch.Tensor],
) -> torch.Tensor:
    """``distill/greedy_agreement`` (the student's greedy token is the teacher's, on response
    tokens) into ``metrics``; returns ``coef *`` the loss-term objective over the teacher's top-k
    tokens (``distill/loss``), or 0 for a dense-advantage objective."""
    teacher_ids = micro["teacher_top_ids"]
    greedy = response_part(outputs.top_ids, width)[..., 0]
    weights = mask.to(torch.float32)
    metrics["distill/greedy_agreement"] = masked_mean((greedy == teacher_ids[..., 0]).float(), weights)
    if distill is None or not distill.adds_loss:
        return torch.zeros((), device=mask.device)
    student = response_part(outputs.gathered_log_probs, width)  # [B, R, k]
    per_token = DISTILL_LOSSES.get(distill.objective)(student, micro["teacher_top_log_probs"], distill.beta)
    term = aggregate_loss(per_token, mask, loss_config.loss_agg_mode, normalizer)
    metrics["distill/loss"] = term.detach()
    return distill.coef * term
