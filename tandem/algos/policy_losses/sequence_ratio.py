"""Policy losses whose importance ratio is defined per sequence: GSPO and GMPO."""

from __future__ import annotations

import dataclasses

import torch

from tandem.algos.masked import masked_mean
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

MAX_LOG_SEQ_RATIO = 10.0  # exp(10) ~ 2.2e4: larger sequence ratios are clamped before exp()
GEOMETRIC_WEIGHT_EPS = 1e-10  # keeps log(w) finite for a weight of 0


@register_policy_loss("gspo")
def compute_gspo_loss(inputs: PolicyLossInput, config: PolicyLossConfig) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): PPO clipping on a length-normalised sequence ratio.

    ``s_i = exp(mean_t log(pi_theta / pi_old))`` over the valid tokens of sequence i. The
    token-level form ``s_{i,t} = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]`` has the value
    of ``s_i`` and the gradient of GSPO-token; with equal advantages within a sequence and
    ``seq-mean-token-mean`` aggregation (the GSPO preset) it is exactly GSPO.
    ``L_t = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - eps_low, 1 + eps_high))``.

    Shapes: ``[B, R]`` -> scalar. Metrics: ``pg_clipfrac``, ``ppo_kl``.
    """
    mask = inputs.mask
    seq_log_ratio = masked_mean(inputs.log_probs - inputs.old_log_probs, mask, dim=-1)
    token_log_ratio = inputs.log_probs - inputs.log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=MAX_LOG_SEQ_RATIO))
    loss_mat, clip_active = clipped_surrogate(ratio, inputs.advantages, config)
    return finish_token_loss(
        loss_mat, inputs, config, {"pg_clipfrac": detached_fraction(clip_active, inputs)}
    )


@register_policy_loss("gmpo", aliases=("geo_mean",))
def compute_gmpo_loss(inputs: PolicyLossInput, config: PolicyLossConfig) -> PolicyLossOutput:
    """GMPO (Zhao et al. 2025, arXiv:2507.20673): maximise the geometric mean of token ratios.

    Token log-ratios are clipped in log space to ``[-eps_low, eps_high]`` on the side that
    the advantage's sign makes pessimistic (``sgn(A) * min(sgn(A) * l, sgn(A) * clip(l))``),
    averaged over the sequence and exponentiated:
    ``L_i = -A_i * exp(mean_t clipped_log_ratio_t)`` with ``A_i`` the token-mean advantage.
    The loss is defined per sequence, so aggregation is always a sequence mean (over the
    global sequence count) whatever ``loss_agg_mode`` says. Rollout-correction weights enter
    as one weight per sequence: their token mean (``gmpo_is_weight_mean=arithmetic``) or
    ``exp(mean_t log w_t)`` (``geometric``, as verl).

    Shapes: ``[B, R]`` -> scalar. Metrics: ``pg_clipfrac`` (clipped tokens with A > 0),
    ``pg_clipfrac_lower`` (clipped tokens with A < 0), ``ppo_kl``.
    """
    mask = inputs.mask
    token_log_ratio = log_ratio(inputs, config)
    sign = torch.sign(inputs.advantages)
    clamped = torch.clamp(token_log_ratio, -config.clip_ratio_low, config.clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * token_log_ratio, sign * clamped)
    seq_ratio = torch.exp(masked_mean(pessimistic, mask, dim=-1))
    seq_advantage = masked_mean(inputs.advantages, mask, dim=-1)
    seq_loss = (-seq_advantage * seq_ratio).unsqueeze(-1).expand_as(mask)
    clipped = token_log_ratio != clamped
    metrics = {
        "pg_clipfrac": detached_fraction(clipped & (inputs.advantages > 0), inputs),
        "pg_clipfrac_lower": detached_fraction(clipped & (inputs.advantages < 0), inputs),
    }
    weights = inputs.rollout_is_weights
    if weights is not None and config.gmpo_is_weight_mean == "geometric":
        seq_weight = torch.exp(masked_mean(torch.log(weights.detach() + GEOMETRIC_WEIGHT_EPS), mask, dim=-1))
        seq_loss = seq_loss * seq_weight.unsqueeze(-1)
        inputs = dataclasses.replace(inputs, rollout_is_weights=None)  # applied here, not again per token
    per_sequence = dataclasses.replace(config, loss_agg_mode="seq-mean-token-mean", pg_loss_agg_mode=None)
    return finish_token_loss(seq_loss, inputs, per_sequence, metrics)
