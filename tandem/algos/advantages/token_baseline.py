"""The optimal token baseline: a per-token baseline for each prompt group, weighted by path variance."""

from __future__ import annotations

import torch

from tandem.algos.advantages.base import (
    AdvantageConfig,
    AdvantageInput,
    AdvantageOutput,
    register_advantage_estimator,
)
from tandem.algos.masked import compact_group_ids

OTB_EPSILON = 1e-8  # added to each group's per-token weight total (verl's constant)


@register_advantage_estimator(
    "optimal_token_baseline",
    requires=("group_ids", "old_log_probs", "sum_pi_squared"),
    uses_if_given=("rollout_is_weights",),
)
def compute_optimal_token_baseline_advantage(
    inputs: AdvantageInput, config: AdvantageConfig
) -> AdvantageOutput:
    """Optimal token baseline (OTB, arXiv:2602.07078; verl's ``optimal_token_baseline``).

    ``G_t = sum_{t' >= t} r_t'`` over valid tokens (reward-to-go). Each token's squared score-
    function norm is proxied by ``w_t = 1 - 2 pi_t + sum_v pi(v)^2`` (``pi_t = exp(old_log_probs)``,
    the sampled token's probability), times ``rho_t^2`` when rollout-correction weights are
    given; ``W_t = sum_{j <= t} w_j`` over valid tokens is the path variance so far. Within each
    prompt group of two or more, the baseline of column ``t`` is
    ``B_t = sum_i G_{i,t} W_{i,t} m_{i,t} / (sum_i W_{i,t} m_{i,t} + eps)``; a group of one gets
    ``B = 0``. When one response is strictly the longest of its group (by valid-token count ``L``),
    its baseline is 0 from column ``L_second`` on (the second-longest count), where no other
    response of the group has tokens. ``A_t = (G_t - B_t) m_t``.

    Shapes: ``token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
    rollout_is_weights: [B, R]``, ``group_ids: [B]`` -> ``advantages [B, R]``, ``returns [B, R]``
    (``G``, unmasked).
    """
    rewards = inputs.token_level_rewards
    mask = inputs.response_mask.to(rewards.dtype)
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    per_token = 1 - 2 * torch.exp(inputs.old_log_probs) + inputs.sum_pi_squared
    if inputs.rollout_is_weights is not None:
        per_token = per_token * inputs.rollout_is_weights.square()
    path_variance = (per_token * mask).cumsum(-1)

    ids, num_groups = compact_group_ids(inputs.group_ids)
    width = rewards.shape[1]
    numerator = rewards.new_zeros(num_groups, width).index_add_(0, ids, returns * path_variance * mask)
    denominator = rewards.new_zeros(num_groups, width).index_add_(0, ids, path_variance * mask)
    size = torch.bincount(ids, minlength=num_groups)[ids]
    baselines = torch.where(
        (size > 1).unsqueeze(-1), (numerator / (denominator + OTB_EPSILON))[ids], torch.zeros_like(returns)
    )
    zero_tail = _beyond_the_second_longest(mask.sum(-1), ids, num_groups, size, width)
    baselines = baselines.masked_fill(zero_tail, 0.0)
    return AdvantageOutput(advantages=(returns - baselines) * mask, returns=returns)


def _beyond_the_second_longest(
    lengths: torch.Tensor, ids: torch.Tensor, num_groups: int, size: torch.Tensor, width: int
) -> torch.Tensor:
    """``[B, width]`` bool: the columns ``t >= L_second`` of each response that is strictly the longest
    of its group (of two or more). ``lengths [B]`` valid-token counts, compact ``ids [B]``, ``size [B]``."""
    lengths = lengths.long()
    unset = torch.full((num_groups,), -1, dtype=torch.long, device=lengths.device)
    longest = unset.scatter_reduce(0, ids, lengths, reduce="amax")
    at_longest = lengths == longest[ids]
    count_at_longest = torch.zeros_like(unset).index_add_(0, ids, at_longest.long())
    second = unset.scatter_reduce(0, ids, torch.where(at_longest, -1, lengths), reduce="amax")
    sole_longest = at_longest & (count_at_longest[ids] == 1) & (size > 1)
    columns = torch.arange(width, device=lengths.device)
    return sole_longest.unsqueeze(-1) & (columns >= second[ids].unsqueeze(-1))
