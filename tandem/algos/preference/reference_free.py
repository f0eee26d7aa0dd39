"""Paired losses without a reference model: SimPO, Bradley–Terry, CPO, AlphaPO and ORPO.

``π_c, π_r`` summed response log-probs, ``π̄ = π/|y|`` their per-token means, ``NLL`` the chosen
responses' per-token NLL (:func:`~tandem.algos.preference.base.chosen_nll`), ``ε`` the label
smoothing. CPO's rewards ``r`` are log-probs (``π`` for ``cpo`` and ``cpo_hinge``, ``π̄`` for
``cpo_ipo``, ``cpo_simpo`` and ``alphapo``), or with AlphaPO's shaping ``α ≠ 0`` the
transformed ``(1 - e^(-α r)) / α``; ``d = r_c - r_r``.

=================  ============================================================================
``simpo``          SimPO: ``-(1-ε) log σ(β(π̄_c - π̄_r) - γ) - ε log σ(-...)``
``bradley_terry``  ``-(1-ε) log σ(β(π_c - π_r)) - ε log σ(-β(π_c - π_r))`` (reward models too)
``cpo``            CPO: ``-(1-ε) log σ(βd) - ε log σ(-βd) + cpo_alpha · NLL``
``cpo_hinge``      ``max(0, 1 - βd) + cpo_alpha · NLL``
``cpo_ipo``        ``(d - 1/(2β))² + cpo_alpha · NLL``
``cpo_simpo``      ``-(1-ε) log σ(βd - γ) - ε log σ(-(βd - γ)) + cpo_alpha · NLL``
``alphapo``        ``cpo_simpo`` with AlphaPO's reward shaping (``alpha ≠ 0``)
``orpo``           ORPO: ``NLL - β log σ(log odds(π̄_c) - log odds(π̄_r))``, ``odds(p) = p/(1-p)``
=================  ============================================================================
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.algos.preference.base import (
    PreferenceInput,
    PreferenceOutput,
    chosen_nll,
    register_preference_loss,
    smoothed_logistic,
)

if TYPE_CHECKING:
    from tandem.algos.preference.config import PreferenceLossConfig


@register_preference_loss("simpo", reference_free=True)
def simpo_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """SimPO: reference-free, length-normalised log-probs, target margin γ (label smoothing as in cDPO)."""
    chosen = config.beta * x.policy_chosen / x.chosen_lengths
    rejected = config.beta * x.policy_rejected / x.rejected_lengths
    loss = smoothed_logistic(chosen - rejected - config.gamma, config.label_smoothing)
    return PreferenceOutput(loss, chosen.detach(), rejected.detach())


@register_preference_loss("bradley_terry", reference_free=True)
def bradley_terry_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """The Bradley–Terry logistic loss on the scaled score difference (label smoothing as in
    cDPO), reference-free: a reward model's loss when the scores are its outputs."""
    chosen, rejected = config.beta * x.policy_chosen, config.beta * x.policy_rejected
    loss = smoothed_logistic(chosen - rejected, config.label_smoothing)
    return PreferenceOutput(loss, chosen.detach(), rejected.detach())


def _cpo_rewards(
    x: PreferenceInput, config: PreferenceLossConfig, per_token: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPO's chosen and rejected rewards ``[P]``: log-probs (per-token means when
    ``per_token``), reshaped by AlphaPO's ``(1 - p^(-α)) / α`` when ``alpha ≠ 0``."""
    chosen, rejected = x.policy_chosen, x.policy_rejected
    if per_token:
        chosen, rejected = chosen / x.chosen_lengths, rejected / x.rejected_lengths
    if config.alpha:
        chosen = (1 - torch.exp(-config.alpha * chosen)) / config.alpha
        rejected = (1 - torch.exp(-config.alpha * rejected)) / config.alpha
    return chosen, rejected


def _cpo_output(
    preference: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor, x: PreferenceInput, config
) -> PreferenceOutput:
    """CPO's preference term plus ``cpo_alpha`` times the chosen NLL, rewards ``β r``. With
    ``cpo_alpha=0`` the NLL is neither computed nor added, and ``nll_loss`` is 0, as TRL's
    ``CPOTrainer`` logs it (SimPO's recommended setting)."""
    if config.cpo_alpha:
        nll = chosen_nll(x)
        loss = preference + config.cpo_alpha * nll
    else:
        nll, loss = torch.zeros_like(preference), preference
    return PreferenceOutput(
        loss, config.beta * chosen.detach(), config.beta * rejected.detach(), {"nll_loss": nll.detach()}
    )


@register_preference_loss("cpo", reference_free=True)
def cpo_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """CPO: DPO's logistic loss without a reference, plus an NLL term on the chosen responses."""
    chosen, rejected = _cpo_rewards(x, config, per_token=False)
    preference = smoothed_logistic(config.beta * (chosen - rejected), config.label_smoothing)
    return _cpo_output(preference, chosen, rejected, x, config)


@register_preference_loss("cpo_hinge", reference_free=True)
def cpo_hinge_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """CPO with SLiC's hinge."""
    chosen, rejected = _cpo_rewards(x, config, per_token=False)
    return _cpo_output(torch.relu(1 - config.beta * (chosen - rejected)), chosen, rejected, x, config)


@register_preference_loss("cpo_ipo", reference_free=True)
def cpo_ipo_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """CPO with IPO's squared loss on per-token mean log-probs."""
    chosen, rejected = _cpo_rewards(x, config, per_token=True)
    return _cpo_output((chosen - rejected - 1 / (2 * config.beta)) ** 2, chosen, rejected, x, config)


def _cpo_simpo(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    chosen, rejected = _cpo_rewards(x, config, per_token=True)
    preference = smoothed_logistic(config.beta * (chosen - rejected) - config.gamma, config.label_smoothing)
    return _cpo_output(preference, chosen, rejected, x, config)


@register_preference_loss("cpo_simpo", reference_free=True)
def cpo_simpo_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """CPO with SimPO's per-token mean log-probs and margin γ (CPO-SimPO)."""
    return _cpo_simpo(x, config)


@register_preference_loss("alphapo", reference_free=True)
def alphapo_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """AlphaPO: CPO-SimPO on the rewards ``(1 - p̄^(-α)) / α`` of per-token mean probabilities ``p̄``."""
    return _cpo_simpo(x, config)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - e^x)`` for ``x < 0``, elementwise, accurate on both sides of ``-log 2``."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@register_preference_loss("orpo", reference_free=True)
def orpo_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """ORPO: the chosen NLL minus β times the log-sigmoid of the log odds ratio of the per-token
    mean probabilities (``log_odds_ratio``: that log-sigmoid; ``log_odds_chosen``: the log odds ratio)."""
    chosen = x.policy_chosen / x.chosen_lengths
    rejected = x.policy_rejected / x.rejected_lengths
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    nll = chosen_nll(x)
    return PreferenceOutput(
        nll - config.beta * ratio,
        config.beta * chosen.detach(),
        config.beta * rejected.detach(),
        {"nll_loss": nll.detach(), "log_odds_ratio": ratio.detach(), "log_odds_chosen": log_odds.detach()},
    )
