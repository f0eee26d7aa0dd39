"""Generalized Advantage Estimation with a learned critic."""

from __future__ import annotations

import torch

from tandem.algos.advantages.base import (
    AdvantageConfig,
    AdvantageInput,
    AdvantageOutput,
    register_token_estimator,
)


@register_token_estimator("gae", requires=("values",), whiten=lambda config: config.whiten_gae)
def compute_gae_advantage(inputs: AdvantageInput, config: AdvantageConfig) -> AdvantageOutput:
    """GAE (Schulman et al. 2016, arXiv:1506.02438) over the action tokens of each response.

    ``delta_t = r_t + gamma * V(s_next) - V(s_t)`` and ``A_t = delta_t + gamma * lam * A_next``,
    where "next" is the next position with ``response_mask = 1``: positions with mask 0
    (tool outputs in a multi-turn rollout) are skipped, so the recursion links one action
    token to the next action token. Past the last action, ``V = 0`` and ``A = 0``.

    Shapes: ``token_level_rewards, values, response_mask: [B, R]`` -> ``advantages, returns: [B, R]``.
    ``returns = A + V``. Both are 0 outside the mask. Row by row: the registered estimator then
    whitens the advantages over the batch's valid tokens when ``config.whiten_gae``.
    """
    rewards, values = inputs.token_level_rewards, inputs.values
    mask = inputs.response_mask.to(rewards.dtype)
    batch, length = rewards.shape
    next_value = torch.zeros(batch, dtype=rewards.dtype, device=rewards.device)
    next_advantage = torch.zeros_like(next_value)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        delta = rewards[:, t] + config.gamma * next_value - values[:, t]
        advantage_t = delta + config.gamma * config.lam * next_advantage
        keep = mask[:, t]
        # A masked position passes the following action's value and advantage through unchanged.
        next_value = keep * values[:, t] + (1 - keep) * next_value
        next_advantage = keep * advantage_t + (1 - keep) * next_advantage
        advantages[:, t] = advantage_t * keep
    returns = (advantages + values) * mask
    return AdvantageOutput(advantages=advantages, returns=returns)
