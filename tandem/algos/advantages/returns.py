"""Critic-free estimators built on (discounted) returns of the token-level rewards."""

from __future__ import annotations

import torch

from tandem.algos.advantages.base import (
    AdvantageConfig,
    AdvantageInput,
    AdvantageOutput,
    register_token_estimator,
)


@register_token_estimator("reinforce_plus_plus", whiten=lambda config: True)
def compute_reinforce_plus_plus_advantage(inputs: AdvantageInput, config: AdvantageConfig) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): whitened discounted returns.

    ``G_t = r_t + gamma * G_next`` where "next" is the next valid token: masked positions
    (padding, tool outputs between turns) are skipped, so a final reward reaches every
    earlier turn. Row by row; the registered estimator then whitens them over all valid tokens of
    the batch. Shapes: ``[B, R]`` -> ``advantages [B, R]`` (the returns), ``returns [B, R]``.
    """
    rewards = inputs.token_level_rewards
    mask = inputs.response_mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        keep = mask[:, t]
        candidate = rewards[:, t] + config.gamma * running
        running = keep * candidate + (1 - keep) * running
        returns[:, t] = candidate * keep
    return AdvantageOutput(advantages=returns, returns=returns.clone())


@register_token_estimator("remax", requires=("reward_baselines",))
def compute_remax_advantage(inputs: AdvantageInput, config: AdvantageConfig) -> AdvantageOutput:
    """ReMax (Li et al. 2023, arXiv:2310.10505): returns minus the greedy response's reward.

    ``G_t = sum_{t' >= t} r_t'`` (undiscounted, valid tokens), ``A_t = G_t - b``, where ``b``
    is ``reward_baselines`` (the score of the greedy response to the same prompt).
    Shapes: ``[B, R]``, baselines ``[B]`` -> ``[B, R]``.
    """
    mask = inputs.response_mask.to(inputs.token_level_rewards.dtype)
    returns = (inputs.token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    advantages = (returns - inputs.reward_baselines.unsqueeze(-1)) * mask
    return AdvantageOutput(advantages=advantages, returns=returns)
