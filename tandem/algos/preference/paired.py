"""Paired losses against a reference: DPO and its variants (TRL's ``loss_type`` list).

Each takes :class:`PreferenceInput` and returns per-pair losses ``[P]`` with the rewards
``β u_c, β u_r`` (``u = π - ρ``, the log-ratio). ``s_c, s_r`` are the f-divergence scores
``f'(π/ρ)`` (``u`` itself for the default reverse KL), ``z = β (s_c - s_r)``, ``ε`` the label
smoothing; ``|c|, |r|`` the response lengths.

==================  ===========================================================================
``sigmoid``         DPO: ``-(1-ε) log σ(z) - ε log σ(-z)`` (``ε>0``: conservative DPO, cDPO)
``robust``          robust DPO: ``((1-ε)(-log σ(z)) + ε log σ(-z)) / (1-2ε)``
``hinge``           SLiC: ``max(0, 1 - z)``
``ipo``             IPO: ``(s_c/|c| - s_r/|r| - 1/(2β))²`` (summed: ``ipo_length_normalized=false``)
``exo_pair``        EXO: ``σ(z)(log σ(z) - log(1-ε)) + σ(-z)(log σ(-z) - log ε)``
``nca_pair``        NCA: ``-log σ(βu_c) - ½ log σ(-βu_c) - ½ log σ(-βu_r)``
``bco_pair``        BCO (paired, no reward shift): ``-log σ(βu_c) - log σ(-βu_r)``
``sppo_hard``       SPPO, hard labels: ``(u_c - 1/(2β))² + (u_r + 1/(2β))²``
``aot``             AOT: the sorted policy margins ``π_c - π_r`` against the sorted reference ones
``aot_unpaired``    AOT unpaired: sorted ``u_c`` against sorted ``u_r``
``apo_zero``        APO-zero: ``1 - σ(βu_c) + σ(βu_r)``
``apo_down``        APO-down: ``σ(βu_c) + 1 - σ(β(u_c - u_r))``
``discopop``        DiscoPOP: ``(1-m)(-log σ(z)) + m e^(-z)``, ``m = σ(z/τ)``
``sigmoid_norm``    DPO on per-token mean scores: ``-log σ(β(s_c/|c| - s_r/|r|))``
``sft``             the chosen responses' per-token NLL (no reference)
==================  ===========================================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.algos.preference.base import (
    PreferenceInput,
    PreferenceOutput,
    chosen_nll,
    f_scores,
    log_ratio_rewards,
    register_preference_loss,
    smoothed_logistic,
)

if TYPE_CHECKING:
    from tandem.algos.preference.config import PreferenceLossConfig


def _with_log_ratio_rewards(loss: torch.Tensor, x: PreferenceInput, beta: float) -> PreferenceOutput:
    chosen, rejected = log_ratio_rewards(x, beta)
    return PreferenceOutput(loss, chosen.detach(), rejected.detach())


def _score_margin(x: PreferenceInput, config: PreferenceLossConfig) -> torch.Tensor:
    """``z = β (s_c - s_r)`` ``[P]``."""
    chosen, rejected = f_scores(x, config)
    return config.beta * (chosen - rejected)


@register_preference_loss("sigmoid", f_divergence=True)
def sigmoid_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """DPO's logistic loss on the log-ratio margin, with optional label smoothing (cDPO)."""
    return _with_log_ratio_rewards(
        smoothed_logistic(_score_margin(x, config), config.label_smoothing), x, config.beta
    )


@register_preference_loss("robust", f_divergence=True)
def robust_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """Robust DPO: the logistic loss debiased for a label-flip rate ε."""
    logits, eps = _score_margin(x, config), config.label_smoothing
    loss = ((1 - eps) * -F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)
    return _with_log_ratio_rewards(loss, x, config.beta)


@register_preference_loss("hinge", f_divergence=True)
def hinge_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """SLiC's hinge on the scaled log-ratio margin."""
    return _with_log_ratio_rewards(torch.relu(1 - _score_margin(x, config)), x, config.beta)


@register_preference_loss("ipo", f_divergence=True)
def ipo_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """IPO: squared distance of the (length-averaged) log-ratio margin from ``1/(2β)``."""
    chosen, rejected = f_scores(x, config)
    chosen_rewards, rejected_rewards = log_ratio_rewards(x, config.beta)
    if config.ipo_length_normalized:
        chosen, rejected = chosen / x.chosen_lengths, rejected / x.rejected_lengths
        chosen_rewards, rejected_rewards = (
            chosen_rewards / x.chosen_lengths,
            rejected_rewards / x.rejected_lengths,
        )
    loss = (chosen - rejected - 1 / (2 * config.beta)) ** 2
    return PreferenceOutput(loss, chosen_rewards.detach(), rejected_rewards.detach())


@register_preference_loss("exo_pair", f_divergence=True)
def exo_pair_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """EXO (pairwise): the reverse KL from the policy's pair distribution ``σ(±z)`` to the
    smoothed labels ``(1-ε, ε)``."""
    logits, eps = _score_margin(x, config), config.label_smoothing
    log_eps, log_one_minus_eps = torch.log(torch.tensor(eps)), torch.log1p(torch.tensor(-eps))
    loss = torch.sigmoid(logits) * (F.logsigmoid(logits) - log_one_minus_eps) + torch.sigmoid(-logits) * (
        F.logsigmoid(-logits) - log_eps
    )
    return _with_log_ratio_rewards(loss, x, config.beta)


@register_preference_loss("nca_pair")
def nca_pair_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """NCA (pairwise): raise the chosen reward in absolute terms and push both below zero."""
    chosen, rejected = log_ratio_rewards(x, config.beta)
    loss = -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)
    return PreferenceOutput(loss, chosen.detach(), rejected.detach())


@register_preference_loss("bco_pair")
def bco_pair_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """BCO on pairs: classify the chosen reward as positive and the rejected as negative."""
    chosen, rejected = log_ratio_rewards(x, config.beta)
    return PreferenceOutput(
        -F.logsigmoid(chosen) - F.logsigmoid(-rejected), chosen.detach(), rejected.detach()
    )


@register_preference_loss("sppo_hard")
def sppo_hard_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """SPPO with hard win probabilities (1 for chosen, 0 for rejected): each log-ratio's squared
    distance from ``±1/(2β)``."""
    chosen = x.policy_chosen - x.reference_chosen
    rejected = x.policy_rejected - x.reference_rejected
    loss = (chosen - 0.5 / config.beta) ** 2 + (rejected + 0.5 / config.beta) ** 2
    return _with_log_ratio_rewards(loss, x, config.beta)


@register_preference_loss("aot")
def aot_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """AOT (paired): the logistic loss between the sorted policy margins ``π_c - π_r`` and the
    sorted reference margins, i.e. first-order stochastic dominance over the micro-batch."""
    policy, _ = torch.sort(x.policy_chosen - x.policy_rejected)
    reference, _ = torch.sort(x.reference_chosen - x.reference_rejected)
    loss = smoothed_logistic(config.beta * (policy - reference), config.label_smoothing)
    return _with_log_ratio_rewards(loss, x, config.beta)


@register_preference_loss("aot_unpaired")
def aot_unpaired_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """AOT (unpaired): the logistic loss between the sorted chosen and the sorted rejected log-ratios."""
    chosen, _ = torch.sort(x.policy_chosen - x.reference_chosen)
    rejected, _ = torch.sort(x.policy_rejected - x.reference_rejected)
    loss = smoothed_logistic(config.beta * (chosen - rejected), config.label_smoothing)
    return _with_log_ratio_rewards(loss, x, config.beta)


@register_preference_loss("apo_zero")
def apo_zero_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """APO-zero: raise the chosen likelihood, lower the rejected (chosen better than the policy)."""
    chosen, rejected = log_ratio_rewards(x, config.beta)
    loss = 1 - torch.sigmoid(chosen) + torch.sigmoid(rejected)
    return PreferenceOutput(loss, chosen.detach(), rejected.detach())


@register_preference_loss("apo_down")
def apo_down_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """APO-down: lower both likelihoods, the rejected more (chosen worse than the policy)."""
    chosen, rejected = log_ratio_rewards(x, config.beta)
    loss = torch.sigmoid(chosen) + 1 - torch.sigmoid(chosen - rejected)
    return PreferenceOutput(loss, chosen.detach(), rejected.detach())


@register_preference_loss("discopop", f_divergence=True)
def discopop_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """DiscoPOP: the logistic and exponential losses blended by ``σ(z/τ)`` of the margin."""
    logits = _score_margin(x, config)
    modulation = torch.sigmoid(logits / config.discopop_tau)
    loss = -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
    return _with_log_ratio_rewards(loss, x, config.beta)


@register_preference_loss("sigmoid_norm", f_divergence=True)
def sigmoid_norm_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """DPO's logistic loss on the margin of per-token mean scores."""
    chosen, rejected = f_scores(x, config)
    logits = config.beta * (chosen / x.chosen_lengths - rejected / x.rejected_lengths)
    return _with_log_ratio_rewards(-F.logsigmoid(logits), x, config.beta)


@register_preference_loss("sft", reference_free=True, f_divergence=True)
def sft_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """The chosen responses' per-token NLL (MPO's quality term); reads no reference."""
    nll = chosen_nll(x)
    output = _with_log_ratio_rewards(nll, x, config.beta)
    return PreferenceOutput(
        output.loss, output.chosen_rewards, output.rejected_rewards, {"nll_loss": nll.detach()}
    )
