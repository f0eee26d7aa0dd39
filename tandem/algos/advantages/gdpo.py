"""GDPO: GRPO normalisation per reward component, then a weighted sum whitened over the batch."""

from __future__ import annotations

import torch

from tandem.algos.advantages.base import AdvantageConfig, RowInput, register_row_estimator
from tandem.algos.advantages.group import grpo_normalised_scores


@register_row_estimator(
    "gdpo", requires=("group_ids",), uses_if_given=("reward_components",), whiten=lambda config: True
)
def compute_gdpo_advantage(inputs: RowInput, config: AdvantageConfig) -> torch.Tensor:
    """GDPO (group reward-decoupled normalisation, arXiv:2601.05242; verl's ``gdpo``).

    Each reward component ``k`` (column of ``reward_components``, named by
    ``gdpo_reward_keys``) is GRPO-normalised within its prompt group on its own,
    ``A_k = (c_k - mean_g) / (std_g + eps)``, so a component with a large spread cannot drown
    the others; then ``A = sum_k w_k A_k`` (``gdpo_reward_weights``, default all 1) is broadcast to
    the valid tokens and whitened over all valid tokens of the batch. With no keys configured
    the total score is the one component (GRPO followed by batch whitening).

    Shapes: ``reward_components [B, K]``, ``[B]`` scores and group ids -> ``[B]`` (spread and
    whitened by the registered estimator: ``advantages [B, R]``, ``returns`` the same tensor).
    """
    keys = config.gdpo_reward_keys
    components = inputs.scores.unsqueeze(-1)
    if keys:
        components = inputs.reward_components
        if components is None or components.shape[1] != len(keys):
            got = "none" if components is None else f"shape {tuple(components.shape)}"
            raise ValueError(
                f"gdpo needs reward_components [B, {len(keys)}] for algorithm.gdpo_reward_keys={list(keys)}; got {got}"
            )
    weights = torch.tensor(
        config.gdpo_reward_weights or (1.0,) * components.shape[1],
        dtype=components.dtype,
        device=components.device,
    )
    combined = torch.zeros_like(components[:, 0])
    for k in range(components.shape[1]):
        normalised = grpo_normalised_scores(
            components[:, k], inputs.group_ids, config.norm_adv_by_std, config.epsilon
        )
        combined = combined + weights[k] * normalised
    return combined
