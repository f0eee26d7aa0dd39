"""Critic-free estimators that compare the n responses of one prompt (outcome rewards).

Each reads the sequence score ``s_i = sum_t token_level_rewards[i, t]`` and the group ids (per-row
scalars: :class:`RowInput`), and gives one advantage per response, spread onto its valid tokens
(``register_row_estimator``). Statistics are computed with vectorised per-group reductions (no
Python loop over samples). Shapes: ``[B]`` scalars -> ``[B]``; the registered estimator ``[B, R]``.

Groups of one: with no other response to compare against, the baseline is taken as 0
(GRPO, RLOO, OPO, REINFORCE++-baseline, GPG), as in verl, so ``n=1`` degrades to plain
REINFORCE on the raw score rather than to NaN or to a silent zero gradient.
"""

from __future__ import annotations

import torch

from tandem.algos.advantages.base import AdvantageConfig, RowInput, register_row_estimator
from tandem.algos.masked import compact_group_ids, group_stats, group_sum


@register_row_estimator("grpo", requires=("group_ids",), aliases=("grpo_vectorized",))
def compute_grpo_advantage(inputs: RowInput, config: AdvantageConfig) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): ``A_i = (s_i - mean_g) / (std_g + eps)``.

    ``std_g`` is the unbiased (Bessel) std of the group's scores. With
    ``norm_adv_by_std=False`` the division is dropped: Dr. GRPO (Liu et al. 2025,
    arXiv:2503.20783). A group whose scores are all equal gets advantage 0.

    Shapes: ``[B]`` scores and group ids -> ``[B]``.
    """
    return grpo_normalised_scores(inputs.scores, inputs.group_ids, config.norm_adv_by_std, config.epsilon)


def grpo_normalised_scores(
    scores: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool, epsilon: float
) -> torch.Tensor:
    """GRPO's per-sequence advantage ``(s_i - mean_g) / (std_g + eps)`` (no division unless
    ``norm_by_std``; a group of one keeps its raw score). Shapes: ``[B], [B] -> [B]``."""
    count, mean, std = group_stats(scores, group_ids)
    single = count == 1
    centred = torch.where(single, scores, scores - mean)
    if norm_by_std:
        centred = centred / torch.where(single, torch.ones_like(std), std + epsilon)
    return centred


# verl's rloo_vectorized: the same math for groups of two or more (verl gives a group of one 0, its loop
# rloo and tandem the score; tandem asks rollout.n >= 2 of every estimator that compares groups)
@register_row_estimator("rloo", requires=("group_ids",), aliases=("rloo_vectorized",))
def compute_rloo_advantage(inputs: RowInput, config: AdvantageConfig) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): ``A_i = s_i - mean_{j != i} s_j`` within the group.

    Equal to ``n / (n - 1) * (s_i - mean_g)``. Shapes: ``[B]`` -> ``[B]``.
    """
    scores = inputs.scores
    count, mean, _ = group_stats(scores, inputs.group_ids)
    leave_one_out = (mean * count - scores) / (count - 1).clamp(min=1)
    return torch.where(count > 1, scores - leave_one_out, scores)


@register_row_estimator("opo", requires=("group_ids",))
def compute_opo_advantage(inputs: RowInput, config: AdvantageConfig) -> torch.Tensor:
    """OPO (Hao et al. 2025, arXiv:2505.23585): the length-weighted optimal baseline.

    ``b_g = sum_i |y_i| s_i / sum_i |y_i|`` over the group, ``A_i = s_i - b_g``, with
    ``|y_i|`` the number of valid response tokens (``lengths``). Shapes: ``[B]`` -> ``[B]``.
    """
    scores = inputs.scores
    lengths = inputs.lengths
    ids, num_groups = compact_group_ids(inputs.group_ids)
    count = group_sum(torch.ones_like(scores), ids, num_groups)[ids]
    weighted = group_sum(lengths * scores, ids, num_groups)[ids]
    total_length = group_sum(lengths, ids, num_groups)[ids]
    baseline = torch.where((count > 1) & (total_length > 0), weighted / total_length.clamp(min=1), 0.0)
    return scores - baseline


@register_row_estimator("reinforce_plus_plus_baseline", requires=("group_ids",), whiten=lambda config: True)
def compute_reinforce_plus_plus_baseline_advantage(inputs: RowInput, config: AdvantageConfig) -> torch.Tensor:
    """REINFORCE++ with group baseline (Hu 2025, arXiv:2501.03262).

    ``s_i - mean_g`` broadcast to tokens, then whitened over all valid tokens of the batch
    (global, not per-group, normalisation: ``whiten``). Shapes: ``[B]`` -> ``[B]`` (before whitening).
    """
    scores = inputs.scores
    count, mean, _ = group_stats(scores, inputs.group_ids)
    return torch.where(count > 1, scores - mean, scores)


@register_row_estimator("grpo_passk", requires=("group_ids",))
def compute_grpo_passk_advantage(inputs: RowInput, config: AdvantageConfig) -> torch.Tensor:
    """Pass@k training (Chen et al. 2025, arXiv:2503.19595, as in verl's ``grpo_passk``).

    Only the best response of each group (first index among ties) is credited, with
    ``A = s_max - s_second`` (divided by the group std + eps when ``norm_adv_by_std``);
    every other response gets 0. Needs at least 2 responses per group.
    Shapes: ``[B]`` -> ``[B]``.
    """
    scores = inputs.scores
    ids, num_groups = compact_group_ids(inputs.group_ids)
    count = group_sum(torch.ones_like(scores), ids, num_groups)
    if bool((count < 2).any()):
        smallest = int(count.min())
        raise ValueError(f"grpo_passk needs at least 2 responses per group; a group has {smallest}")
    neg_inf = torch.full((num_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    best = neg_inf.scatter_reduce(0, ids, scores, reduce="amax")
    positions = torch.arange(scores.numel(), device=scores.device)
    is_best = scores == best[ids]
    sentinel = torch.full((num_groups,), scores.numel(), dtype=torch.long, device=scores.device)
    first_best = sentinel.scatter_reduce(
        0, ids, torch.where(is_best, positions, scores.numel()), reduce="amin"
    )
    winner = positions == first_best[ids]
    second = neg_inf.scatter_reduce(0, ids, torch.where(winner, float("-inf"), scores), reduce="amax")
    gap = best - second
    if config.norm_adv_by_std:
        _, _, std = group_stats(scores, inputs.group_ids)
        gap = gap[ids] / (std + config.epsilon)
    else:
        gap = gap[ids]
    return torch.where(winner, gap, torch.zeros_like(gap))


@register_row_estimator("gpg", requires=("group_ids",))
def compute_gpg_advantage(inputs: RowInput, config: AdvantageConfig) -> torch.Tensor:
    """GPG (Chu et al. 2025, arXiv:2504.02546): ``A_i = alpha * (s_i - mean_g) / F_norm``.

    ``alpha = B / (B - M)`` rescales for the ``M`` samples whose group has no reward spread
    (their advantage is 0, so they would otherwise dilute the gradient); ``F_norm`` is
    ``config.gpg_f_norm``. Shapes: ``[B]`` -> ``[B]``.
    """
    scores = inputs.scores
    count, mean, std = group_stats(scores, inputs.group_ids)
    centred = torch.where(count > 1, scores - mean, scores)
    degenerate = (count > 1) & (std == 0)
    batch = scores.numel()
    alpha = batch / (batch - degenerate.sum()).clamp(min=1)
    return alpha * centred / config.gpg_f_norm
