"""DRO: the policy gradient with a quadratic penalty on the log-ratio to the behaviour policy."""

from __future__ import annotations

from tandem.algos.masked import masked_mean
from tandem.algos.policy_losses.base import (
    PolicyLossConfig,
    PolicyLossInput,
    PolicyLossOutput,
    finish_token_loss,
    register_policy_loss,
)


@register_policy_loss("dro")
def compute_dro_loss(inputs: PolicyLossInput, config: PolicyLossConfig) -> PolicyLossOutput:
    """DRO's policy objective (after Richemond et al. 2024, arXiv:2405.19107; verl's ``dro`` loss).

    ``L_t = -(A_t log pi_theta(a_t) - (beta / 2) (log pi_theta(a_t) - log pi_old(a_t))^2)`` with
    ``beta = dro_beta``: a REINFORCE term whose gradient ``-(A_t - beta l_t) d log pi_theta`` is
    pulled back towards the behaviour policy as the log-ratio ``l_t`` grows. The log-ratio has
    no ``exp`` to overflow and is never clamped (``log_ratio_clamp`` does not apply), as in verl.
    The advantages are the caller's (DRO's soft off-policy formulation expects its own).

    Shapes: ``[B, R]`` -> scalar. Metrics: ``ppo_kl`` (from the unclamped log-ratio).
    """
    token_log_ratio = inputs.log_probs - inputs.old_log_probs
    loss_mat = -(inputs.advantages * inputs.log_probs - 0.5 * config.dro_beta * token_log_ratio.square())
    ppo_kl = masked_mean(-token_log_ratio.detach(), inputs.mask)
    return finish_token_loss(loss_mat, inputs, config, {"ppo_kl": ppo_kl})
