"""Losses of the REINFORCE form ``-w * A * log pi`` with a detached weight: GPG, CISPO, DPPO."""

from __future__ import annotations

import torch

from tandem.algos.policy_losses.base import (
    PolicyLossConfig,
    PolicyLossInput,
    PolicyLossOutput,
    detached_fraction,
    finish_token_loss,
    register_policy_loss,
)

PROB_EPS = 1e-6  # keeps binary-KL logs finite at probabilities of exactly 0 or 1


@register_policy_loss("gpg")
def compute_gpg_loss(inputs: PolicyLossInput, config: PolicyLossConfig) -> PolicyLossOutput:
    """GPG (Chu et al. 2025, arXiv:2504.02546): plain policy gradient ``L_t = -A_t log pi_theta(a_t)``.

    No ratio and no clipping (pair it with the ``gpg`` advantage estimator).
    Shapes: ``[B, R]`` -> scalar. Metrics: ``ppo_kl``.
    """
    return finish_token_loss(-inputs.advantages * inputs.log_probs, inputs, config, {})


@register_policy_loss("cispo")
def compute_cispo_loss(inputs: PolicyLossInput, config: PolicyLossConfig) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance weight, not the update.

    ``L_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi_theta(a_t)``: every
    token keeps a gradient (PPO drops clipped tokens entirely); only its weight is bounded.
    The paper effectively has no lower bound: set ``clip_ratio_low=1.0``.

    Shapes: ``[B, R]`` -> scalar. Metrics: ``pg_clipfrac`` (tokens whose weight was clipped), ``ppo_kl``.
    """
    ratio = torch.exp(inputs.log_ratio).detach()
    weight = torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    metrics = {"pg_clipfrac": detached_fraction(weight != ratio, inputs)}
    return finish_token_loss(-weight * inputs.advantages * inputs.log_probs, inputs, config, metrics)


def _dppo_loss(inputs: PolicyLossInput, config: PolicyLossConfig, inside: torch.Tensor) -> PolicyLossOutput:
    ratio = torch.exp(inputs.log_ratio).detach()
    weight = torch.clamp(ratio, max=config.dppo_ratio_cap)
    loss_mat = -inputs.advantages * weight * inputs.log_probs * inside.detach().to(inputs.log_probs.dtype)
    return finish_token_loss(loss_mat, inputs, config, {"pg_clipfrac": detached_fraction(~inside, inputs)})


@register_policy_loss("dppo_tv")
def compute_dppo_tv_loss(inputs: PolicyLossInput, config: PolicyLossConfig) -> PolicyLossOutput:
    """DPPO with a binary total-variation trust region (arXiv:2602.04879).

    With ``p = pi_theta(a_t)`` and ``q = pi_old(a_t)``: a token is updated only while its
    probability has not moved past the threshold in the direction its advantage pushes
    (``p - q <= delta_high`` for A > 0, ``p - q >= -delta_low`` for A < 0).
    ``L_t = -A_t * sg(min(r_t, cap)) * log pi_theta(a_t) * inside_t``, whose gradient is
    the truncated importance-weighted policy gradient.

    Shapes: ``[B, R]`` -> scalar. Metrics: ``pg_clipfrac`` (tokens outside the region), ``ppo_kl``.
    """
    divergence = (torch.exp(inputs.log_probs) - torch.exp(inputs.old_log_probs)).detach()
    inside = torch.where(
        inputs.advantages > 0,
        divergence <= config.dppo_divergence_high,
        torch.where(inputs.advantages < 0, divergence >= -config.dppo_divergence_low, True),
    )
    return _dppo_loss(inputs, config, inside)


@register_policy_loss("dppo_kl")
def compute_dppo_kl_loss(inputs: PolicyLossInput, config: PolicyLossConfig) -> PolicyLossOutput:
    """DPPO with a binary KL trust region (arXiv:2602.04879).

    ``D = q log(q/p) + (1-q) log((1-q)/(1-p))`` between Bernoulli(q = pi_old(a_t)) and
    Bernoulli(p = pi_theta(a_t)). A token stops being updated once ``D`` exceeds the
    threshold while ``p`` has moved in its advantage's direction (up for A > 0 with
    ``delta_high``, down for A < 0 with ``delta_low``). Loss as in ``dppo_tv``.

    Shapes: ``[B, R]`` -> scalar. Metrics: ``pg_clipfrac``, ``ppo_kl``.
    """
    p = torch.exp(inputs.log_probs.detach()).clamp(PROB_EPS, 1 - PROB_EPS)
    q = torch.exp(inputs.old_log_probs.detach()).clamp(PROB_EPS, 1 - PROB_EPS)
    binary_kl = q * torch.log(q / p) + (1 - q) * torch.log((1 - q) / (1 - p))
    outside_up = (inputs.advantages > 0) & (p > q) & (binary_kl > config.dppo_divergence_high)
    outside_down = (inputs.advantages < 0) & (p < q) & (binary_kl > config.dppo_divergence_low)
    return _dppo_loss(inputs, config, ~(outside_up | outside_down))
