"""SAPO: a smooth gate in place of PPO's hard clip."""

from __future__ import annotations

import torch

from tandem.algos.masked import masked_mean
from tandem.algos.policy_losses.base import (
    PolicyLossConfig,
    PolicyLossInput,
    PolicyLossOutput,
    finish_token_loss,
    log_ratio,
    register_policy_loss,
)


@register_policy_loss("sapo")
def compute_sapo_loss(inputs: PolicyLossInput, config: PolicyLossConfig) -> PolicyLossOutput:
    """SAPO (Gao et al. 2025, Soft Adaptive Policy Optimization, arXiv:2511.20347).

    ``L_t = -f(r_t; tau) * A_t`` with the gate ``f(r; tau) = (4 / tau) * sigmoid(tau (r - 1))``
    and ``tau = tau_pos`` for ``A > 0``, ``tau_neg`` otherwise. At ``r = 1`` the gate's
    slope is 1, so on-policy it gives the plain policy gradient; away from 1 the gradient
    fades smoothly instead of dropping to zero at a clip boundary.

    Shapes: ``[B, R]`` -> scalar. Metrics: ``sapo_gate_mean`` (mean gate value), ``ppo_kl``.
    """
    ratio = torch.exp(log_ratio(inputs, config))
    tau = torch.where(
        inputs.advantages > 0, ratio.new_tensor(config.sapo_tau_pos), ratio.new_tensor(config.sapo_tau_neg)
    )
    gate = torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau)
    metrics = {"sapo_gate_mean": masked_mean(gate.detach(), inputs.mask)}
    return finish_token_loss(-gate * inputs.advantages, inputs, config, metrics)
