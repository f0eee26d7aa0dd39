"""The critic's clipped value loss and the entropy term."""

from __future__ import annotations

import torch

from tandem.algos.aggregation import LossNormalizer, aggregate_loss
from tandem.algos.masked import masked_mean


def compute_value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float | None,
    loss_agg_mode: str = "token-mean",
    normalizer: LossNormalizer | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO, arXiv:1707.06347; clipping as in OpenAI baselines).

    ``V_clip = V_old + clip(V - V_old, -c, c)`` and
    ``L_t = 0.5 * max((V - G)^2, (V_clip - G)^2)``; without ``clip_range``, ``0.5 (V - G)^2``.

    ``loss_agg_mode`` is any of ``LOSS_AGG_MODES`` (``token-sum``: ``sum_t L_t``, no division).
    Shapes: ``values, returns, old_values, response_mask: [B, R]`` -> scalar.
    Metrics: ``vf_clipfrac`` (tokens where the clipped error is the larger one).
    """
    unclipped = (values - returns).square()
    if clip_range is None:
        loss_mat = 0.5 * unclipped
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        clipped = (clipped_values - returns).square()
        loss_mat = 0.5 * torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).to(values.dtype), response_mask.to(values.dtype))
    loss = aggregate_loss(loss_mat, response_mask, loss_agg_mode, normalizer)
    return loss, {"vf_clipfrac": clipfrac.detach()}


def compute_entropy_term(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    normalizer: LossNormalizer | None = None,
) -> torch.Tensor:
    """Aggregate per-token entropy ``[B, R]`` like the policy loss (subtract ``coef *`` this to encourage exploration)."""
    return aggregate_loss(entropy, response_mask, loss_agg_mode, normalizer)
