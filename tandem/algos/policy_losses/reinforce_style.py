"""Losses of the REINFORCE form ``-w * A * log pi`` with a detached weight: GPG, CISPO, DPPO."""

from __future__ import annotations

import torch

from tandem.algos.policy_losses.base import (
    PolicyLossConfig,
    PolicyLossInput,
    PolicyLossOutput,
    detached_fraction,
    finish_token_loss,
    log_ratio,
    register_policy_loss,
)

PROB_EPS = 1e-8  # keeps the binary KL's log((1-q)/(1-p)) finite at probabilities of exactly 1


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
    ratio = torch.exp(log_ratio(inputs, config)).detach()
    weight = torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    metrics = {"pg_clipfrac": detached_fraction(weight != ratio, inputs)}
    return finish_token_loss(-weight * inputs.advantages * inputs.log_probs, inputs, config, metrics)


def _dppo_loss(
    inputs: PolicyLossInput, config: PolicyLossConfig, outside_up: torch.Tensor, outside_down: torch.Tensor
) -> PolicyLossOutput:
    """The DPPO loss given where ``p`` left the region upwards / downwards (``[B, R]`` bool each)."""
    ratio = torch.exp(log_ratio(inputs, config)).detach()
    weight = torch.clamp(ratio, max=config.dppo_ratio_cap)
    advantages = inputs.advantages
    down_side = advantages < 0
    if config.dppo_zero_advantage_region == "negative":
        down_side = advantages <= 0
    inside = ~(((advantages > 0) & outside_up) | (down_side & outside_down))
    loss_mat = -advantages * weight * inputs.log_probs * inside.to(inputs.log_probs.dtype)
    metrics = {
        "pg_clipfrac": detached_fraction(~inside, inputs),
        "pg_clipfrac_lower": detached_fraction(inside & (ratio > config.dppo_ratio_cap), inputs),
    }
    return finish_token_loss(loss_mat, inputs, config, metrics)


@register_policy_loss("dppo_tv")
def compute_dppo_tv_loss(inputs: PolicyLossInput, config: PolicyLossConfig) -> PolicyLossOutput:
    """DPPO with a binary total-variation trust region (arXiv:2602.04879).

    With ``p = pi_theta(a_t)`` and ``q = pi_old(a_t)``: a token is updated only while its
    probability has not moved past the threshold in the direction its advantage pushes
    (``p - q <= delta_high`` for A > 0, ``p - q >= -delta_low`` for A < 0).
    ``L_t = -A_t * sg(min(r_t, cap)) * log pi_theta(a_t) * inside_t``, whose gradient is
    the truncated importance-weighted policy gradient. A token with ``A = 0`` counts as inside
    unless ``dppo_zero_advantage_region=negative`` (verl tests it against the A < 0 bound).

    Shapes: ``[B, R]`` -> scalar. Metrics: ``pg_clipfrac`` (tokens outside the region),
    ``pg_clipfrac_lower`` (tokens inside whose ratio exceeds the cap, as verl), ``ppo_kl``.
    """
    divergence = (torch.exp(inputs.log_probs) - torch.exp(inputs.old_log_probs)).detach()
    return _dppo_loss(
        inputs, config, divergence > config.dppo_divergence_high, divergence < -config.dppo_divergence_low
    )


@register_policy_loss("dppo_kl")
def compute_dppo_kl_loss(inputs: PolicyLossInput, config: PolicyLossConfig) -> PolicyLossOutput:
    """DPPO with a binary KL trust region (arXiv:2602.04879).

    ``D = q (log q - log p) + (1-q) log((1-q+eps)/(1-p+eps))`` between Bernoulli(q = pi_old(a_t))
    and Bernoulli(p = pi_theta(a_t)), the first term from the log-probs themselves, ``eps = 1e-8``.
    A token stops being updated once ``D`` exceeds the threshold while ``p`` has moved in its
    advantage's direction (up for A > 0 with ``delta_high``, down for A < 0 with ``delta_low``).
    Loss, zero-advantage tokens and metrics as in ``dppo_tv``.

    Shapes: ``[B, R]`` -> scalar. Metrics: ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``.
    """
    log_p, log_q = inputs.log_probs.detach(), inputs.old_log_probs
    p, q = torch.exp(log_p), torch.exp(log_q)
    binary_kl = q * (log_q - log_p) + (1 - q) * torch.log((1 - q + PROB_EPS) / (1 - p + PROB_EPS))
    return _dppo_loss(
        inputs,
        config,
        (p > q) & (binary_kl > config.dppo_divergence_high),
        (p < q) & (binary_kl > config.dppo_divergence_low),
    )
