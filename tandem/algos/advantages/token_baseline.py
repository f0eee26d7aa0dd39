"""The optimal token baseline: a per-token baseline for each prompt group, weighted by path variance."""

from __future__ import annotations

import torch

from tandem.algos.advantages.base import (
    AdvantageConfig,
    AdvantageInput,
    AdvantageOutput,
    EstimatorSplit,
    register_advantage_estimator,
)
from tandem.algos.masked import compact_group_ids

OTB_EPSILON = 1e-8  # added to each group's per-token weight total (verl's constant)


@register_advantage_estimator(
    "optimal_token_baseline",
    requires=("group_ids", "old_log_probs", "sum_pi_squared"),
    uses_if_given=("rollout_is_weights",),
    split=EstimatorSplit("positions"),  # the pieces below: per row, per group and position, per row
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

    Made of pieces that run where the rows are (``EstimatorSplit("positions")``): the per-row
    terms (:func:`otb_path_terms`), their sums per group and position (:func:`otb_group_sums`,
    added over the ranks' rows), the baselines of those sums (:func:`otb_baselines`), the columns
    they stop at from per-row counts (:func:`otb_zero_from`) and the advantages (:func:`otb_advantages`).
    """
    mask = inputs.response_mask.to(inputs.token_level_rewards.dtype)
    returns, weighted, weights = otb_path_terms(
        inputs.token_level_rewards,
        mask,
        inputs.old_log_probs,
        inputs.sum_pi_squared,
        inputs.rollout_is_weights,
    )
    ids, num_groups = compact_group_ids(inputs.group_ids)
    weighted_sums, weight_sums = otb_group_sums(weighted, weights, ids, num_groups)
    zero_from = otb_zero_from(mask.sum(-1), ids, num_groups, returns.shape[1])
    baselines = otb_baselines(weighted_sums, weight_sums)[ids]
    return AdvantageOutput(advantages=otb_advantages(returns, mask, baselines, zero_from), returns=returns)


def otb_path_terms(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row by row: the reward-to-go ``G``, and the baseline's numerator and denominator terms
    ``G W m`` and ``W m`` (``[b, R]`` each; ``mask`` in the rewards' dtype)."""
    returns = reward_to_go(rewards, mask)
    per_token = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights.square()
    path_variance = (per_token * mask).cumsum(-1)
    return returns, returns * path_variance * mask, path_variance * mask


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``G [b, R]``: each row's sum of its valid tokens' rewards from each column on."""
    return (rewards * mask).flip(-1).cumsum(-1).flip(-1)


def otb_group_sums(
    weighted: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num_groups, R]`` each: the terms of :func:`otb_path_terms` summed per group and position
    (rows in order; ``ids [b]`` compact group ids). Where the rows are split over ranks, each rank
    sums its own and the sums are added."""
    width = weighted.shape[1]
    weighted_sums = weighted.new_zeros(num_groups, width).index_add_(0, ids, weighted)
    return weighted_sums, weighted.new_zeros(num_groups, width).index_add_(0, ids, weights)


def otb_baselines(weighted_sums: torch.Tensor, weight_sums: torch.Tensor) -> torch.Tensor:
    """``[G, R]``: each group's per-position baseline from its summed terms."""
    return weighted_sums / (weight_sums + OTB_EPSILON)


def otb_zero_from(lengths: torch.Tensor, ids: torch.Tensor, num_groups: int, width: int) -> torch.Tensor:
    """``[B]`` int64: the column from which each row's baseline is 0 (``width``: none): 0 for a
    group of one, the second-longest count for a response strictly the longest of its group. From
    per-row scalars only (``lengths [B]`` valid-token counts, compact ``ids [B]``)."""
    size = torch.bincount(ids, minlength=num_groups)[ids]
    lengths = lengths.long()
    unset = torch.full((num_groups,), -1, dtype=torch.long, device=lengths.device)
    longest = unset.scatter_reduce(0, ids, lengths, reduce="amax")
    at_longest = lengths == longest[ids]
    count_at_longest = torch.zeros_like(unset).index_add_(0, ids, at_longest.long())
    second = unset.scatter_reduce(0, ids, torch.where(at_longest, -1, lengths), reduce="amax")
    sole_longest = at_longest & (count_at_longest[ids] == 1) & (size > 1)
    zero_from = torch.where(sole_longest, second[ids], torch.full_like(lengths, width))
    return torch.where(size > 1, zero_from, torch.zeros_like(lengths))


def otb_advantages(
    returns: torch.Tensor, mask: torch.Tensor, baselines: torch.Tensor, zero_from: torch.Tensor
) -> torch.Tensor:
    """Row by row: ``(G - B) m`` with each row's baseline ``baselines [b, R]`` set to 0 from its
    column ``zero_from [b]`` on (:func:`otb_zero_from`)."""
    columns = torch.arange(returns.shape[1], device=returns.device)
    baselines = baselines.masked_fill(columns >= zero_from.unsqueeze(-1), 0.0)
    return (returns - baselines) * mask
