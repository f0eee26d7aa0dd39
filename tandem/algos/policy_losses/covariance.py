"""Clip-Cov and KL-Cov: entropy-preserving losses that act on high-covariance tokens.

Both follow Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models" (arXiv:2505.22617). The per-token covariance
``cov_t = (A_t - mean A) * (log pi_t - mean log pi)`` (means over the valid tokens of the
micro-batch) marks tokens whose updates collapse entropy fastest.

Token selection is done by ranking (no host sync): the ``k = max(1, floor(ratio * N))``
selected tokens, with ``N`` valid tokens, are the eligible ones of highest priority.
"""

from __future__ import annotations

import torch

from tandem.algos.masked import masked_mean
from tandem.algos.policy_losses.base import (
    PolicyLossConfig,
    PolicyLossInput,
    PolicyLossOutput,
    clipped_surrogate,
    detached_fraction,
    finish_token_loss,
    log_ratio,
    register_policy_loss,
)


def token_covariance(inputs: PolicyLossInput) -> torch.Tensor:
    """``[B, R]`` detached centred product of advantage and log-prob over valid tokens."""
    mask = inputs.mask
    log_probs = inputs.log_probs.detach()
    return (inputs.advantages - masked_mean(inputs.advantages, mask)) * (
        log_probs - masked_mean(log_probs, mask)
    )


def select_top(priority: torch.Tensor, eligible: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the ``count`` eligible entries with the highest priority (ties: lower index first).

    Shapes: ``priority, eligible: [B, R]``, ``count: 0-D`` -> ``[B, R]`` bool.
    """
    flat = torch.where(
        eligible, priority, torch.tensor(float("-inf"), dtype=priority.dtype, device=priority.device)
    )
    flat = flat.flatten()
    order = torch.argsort(flat, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return eligible & (rank < count).reshape(eligible.shape)


def _selection_count(inputs: PolicyLossInput, ratio: float) -> torch.Tensor:
    return torch.clamp(torch.floor(inputs.mask.sum() * ratio), min=1)


@register_policy_loss("clip_cov")
def compute_clip_cov_loss(inputs: PolicyLossInput, config: PolicyLossConfig) -> PolicyLossOutput:
    """Clip-Cov: PPO-clip, plus detach the gradient of a random few high-covariance tokens.

    Among valid tokens not already clipped by PPO with ``clip_cov_lb < cov < clip_cov_ub``,
    ``k = max(1, floor(clip_cov_ratio * N))`` are drawn uniformly (``inputs.generator``) and
    their loss is set to 0. Shapes: ``[B, R]`` -> scalar.
    Metrics: ``pg_clipfrac`` (fraction of tokens detached), ``ppo_kl``.
    """
    surrogate, clip_active = clipped_surrogate(
        torch.exp(log_ratio(inputs, config)), inputs.advantages, config
    )
    cov = token_covariance(inputs)
    valid = inputs.response_mask.bool()
    eligible = valid & ~clip_active & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
    priority = torch.rand(cov.shape, generator=inputs.generator, device=cov.device, dtype=cov.dtype)
    detached = select_top(priority, eligible, _selection_count(inputs, config.clip_cov_ratio))
    loss_mat = torch.where(detached, torch.zeros_like(surrogate), surrogate)
    return finish_token_loss(loss_mat, inputs, config, {"pg_clipfrac": detached_fraction(detached, inputs)})


@register_policy_loss("kl_cov")
def compute_kl_cov_loss(inputs: PolicyLossInput, config: PolicyLossConfig) -> PolicyLossOutput:
    """KL-Cov: unclipped surrogate, plus a KL penalty on the top-covariance tokens.

    ``L_t = -A_t r_t`` for all tokens, ``+ kl_cov_coef * |log pi_theta - log pi_old|`` on the
    ``k = max(1, floor(kl_cov_ratio * N))`` valid tokens of largest covariance.
    Shapes: ``[B, R]`` -> scalar. Metrics: ``kl_cov_frac`` (fraction penalised), ``ppo_kl``, and
    ``ppo_kl_abs`` (mean ``|log pi_theta - log pi_old|``: what verl's kl_cov reports as ``ppo_kl``).
    """
    token_log_ratio = log_ratio(inputs, config)
    surrogate = -inputs.advantages * torch.exp(token_log_ratio)
    penalised = select_top(
        token_covariance(inputs), inputs.response_mask.bool(), _selection_count(inputs, config.kl_cov_ratio)
    )
    loss_mat = surrogate + penalised.to(surrogate.dtype) * config.kl_cov_coef * token_log_ratio.abs()
    metrics = {
        "kl_cov_frac": detached_fraction(penalised, inputs),
        "ppo_kl_abs": masked_mean(token_log_ratio.detach().abs(), inputs.mask),
    }
    return finish_token_loss(loss_mat, inputs, config, metrics)
