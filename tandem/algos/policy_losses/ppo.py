"""The PPO clipped surrogate with asymmetric (clip-higher) and dual clipping."""

from __future__ import annotations

import torch

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


@register_policy_loss("ppo", aliases=("vanilla",))
def compute_ppo_loss(inputs: PolicyLossInput, config: PolicyLossConfig) -> PolicyLossOutput:
    """PPO-clip (Schulman et al. 2017, arXiv:1707.06347) with clip-higher and dual-clip.

    Per token, with ``r = pi_theta / pi_old``:
    ``L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``; DAPO's clip-higher (Yu et al.
    2025, arXiv:2503.14476) is ``eps_high > eps_low``. Dual-clip (Ye et al. 2020,
    arXiv:1912.09729) caps the loss of negative-advantage tokens at ``-A c``:
    ``L = min(L, -A c)`` for ``A < 0`` when ``clip_ratio_c`` is set.

    Shapes: all inputs ``[B, R]`` -> scalar. Metrics: ``pg_clipfrac`` (tokens where the clip
    is active), ``pg_clipfrac_lower`` (tokens where the dual clip is active), ``ppo_kl``.
    """
    advantages = inputs.advantages
    loss_mat, clip_active = clipped_surrogate(torch.exp(log_ratio(inputs, config)), advantages, config)
    metrics = {"pg_clipfrac": detached_fraction(clip_active, inputs)}
    if config.clip_ratio_c is not None:
        dual_bound = -advantages * config.clip_ratio_c
        dual_active = (advantages < 0) & (loss_mat > dual_bound)
        loss_mat = torch.where(dual_active, dual_bound, loss_mat)
        metrics["pg_clipfrac_lower"] = detached_fraction(dual_active, inputs)
    else:
        metrics["pg_clipfrac_lower"] = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    return finish_token_loss(loss_mat, inputs, config, metrics)
