"""A tandem plugin: PPO's clipped surrogate without the dual clip, as a policy loss of its own.

    tandem train --plugin examples/plugins/policy_loss.py actor.policy_loss.name=ppo_clip_only ...

A policy loss maps per-token log-probs to this micro-batch's share of the step's loss; the
helpers of ``tandem.algos.policy_losses.base`` apply the rollout-correction weights, aggregate
by ``actor.policy_loss.loss_agg_mode`` and add the ``ppo_kl`` metric, as every built-in loss does.
"""

import torch

from tandem.algos import PolicyLossConfig, PolicyLossInput, PolicyLossOutput, register_policy_loss
from tandem.algos.policy_losses.base import detached_fraction, finish_token_loss, log_ratio


@register_policy_loss("ppo_clip_only")
def ppo_clip_only(inputs: PolicyLossInput, config: PolicyLossConfig) -> PolicyLossOutput:
    """``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` per token, ``r = pi / pi_old``.

    Shapes: all inputs ``[B, R]`` -> a scalar loss; metric ``pg_clipfrac``: where the clip binds.
    """
    ratio = torch.exp(log_ratio(inputs, config))  # [B, R], the log-ratio clamped for exp()
    unclipped = -inputs.advantages * ratio
    clipped = -inputs.advantages * ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    metrics = {"pg_clipfrac": detached_fraction(clipped > unclipped, inputs)}
    return finish_token_loss(loss_mat, inputs, config, metrics)
