"""Preference-optimization losses (DPO and its family), registered by name in ``PREFERENCE_LOSSES``.

Every loss sees a batch of pairs as :class:`PreferenceInput`: per pair, the summed response
log-probabilities of the chosen and the rejected response under the policy and under the
reference, and the response lengths in tokens. It returns the per-pair loss ``[P]`` and the
implicit rewards of chosen and rejected ``[P]`` (what ``rewards/*`` metrics report).

Notation: ``π_c, π_r`` policy log-probs of chosen / rejected, ``ρ_c, ρ_r`` reference ones,
``h = (π_c - ρ_c) - (π_r - ρ_r)`` the log-ratio margin, ``β`` the inverse temperature,
``ε`` the label smoothing, ``σ`` the logistic function.

=============  ==============================================================================
``sigmoid``    DPO: ``-(1-ε) log σ(βh) - ε log σ(-βh)`` (``ε>0``: conservative DPO, cDPO)
``ipo``        IPO: ``(h̄ - 1/(2β))²`` with ``h̄`` the margin of length-averaged log-probs
``hinge``      SLiC: ``max(0, 1 - βh)``
``robust``     robust DPO (unbiased under flip rate ε): ``((1-ε)(-log σ(βh)) + ε log σ(-βh)) / (1-2ε)``
``simpo``      SimPO, reference-free: ``-log σ(β(π_c/|c| - π_r/|r|) - γ)``
``bradley_terry``  reference-free: ``-(1-ε) log σ(β(π_c - π_r)) - ε log σ(-β(π_c - π_r))``; with
               a reward model's scores in place of ``π`` it is the reward-model loss (``tandem rm``)
=============  ==============================================================================

An NLL term on the chosen responses (RPO, ``rpo_alpha``) is added by the trainer, not here: it
is a per-token mean over chosen tokens, not a function of the pair sums.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.config.validation import check_positive, check_range
from tandem.registry import Registry


@dataclass(frozen=True)
class PreferenceLossConfig:
    """``preference.*`` (``tandem dpo``) / ``actor.preference.*`` (online DPO): the preference loss.

    Attributes:
        name: a registered preference loss (``sigmoid``, ``ipo``, ``hinge``, ``robust``, ``simpo``,
            ``bradley_terry``).
        beta: inverse temperature β (how far the policy may move from the reference).
        label_smoothing: ε, the assumed rate of flipped labels (``sigmoid``: cDPO; ``robust``); < 0.5.
        gamma: SimPO's target reward margin γ.
        rpo_alpha: weight of the NLL term on chosen responses (RPO); 0 turns it off.
    """

    name: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5
    rpo_alpha: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in PREFERENCE_LOSSES:
            raise ValueError(
                f"preference.name={self.name!r} is not a preference loss; registered: {PREFERENCE_LOSSES.names()}"
            )
        check_positive("preference", "beta", self.beta)
        check_range(
            "preference", "label_smoothing", self.label_smoothing, low=0.0, high=0.5, high_inclusive=False
        )
        check_range("preference", "rpo_alpha", self.rpo_alpha, low=0.0)

    @property
    def needs_reference(self) -> bool:
        return self.name not in REFERENCE_FREE


@dataclass(frozen=True)
class PreferenceInput:
    """One batch of pairs, all ``[P]`` fp32: summed response log-probs and response lengths."""

    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    reference_chosen: torch.Tensor
    reference_rejected: torch.Tensor
    chosen_lengths: torch.Tensor
    rejected_lengths: torch.Tensor


PreferenceLoss = Callable[
    [PreferenceInput, PreferenceLossConfig], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]
PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry("preference loss")
REFERENCE_FREE = frozenset({"simpo", "bradley_terry"})


def _smoothed_logistic(logits: torch.Tensor, eps: float) -> torch.Tensor:
    """``-(1-ε) log σ(z) - ε log σ(-z)``: the logistic loss with label smoothing ε."""
    return -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)


def _log_ratio_rewards(x: PreferenceInput, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    return beta * (x.policy_chosen - x.reference_chosen), beta * (x.policy_rejected - x.reference_rejected)


@PREFERENCE_LOSSES.register("sigmoid")
def sigmoid_loss(
    x: PreferenceInput, config: PreferenceLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's logistic loss on the log-ratio margin, with optional label smoothing (cDPO)."""
    chosen, rejected = _log_ratio_rewards(x, config.beta)
    return _smoothed_logistic(chosen - rejected, config.label_smoothing), chosen.detach(), rejected.detach()


@PREFERENCE_LOSSES.register("robust")
def robust_loss(
    x: PreferenceInput, config: PreferenceLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Robust DPO: the logistic loss debiased for a label-flip rate ε."""
    chosen, rejected = _log_ratio_rewards(x, config.beta)
    logits = chosen - rejected
    eps = config.label_smoothing
    loss = ((1 - eps) * -F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)
    return loss, chosen.detach(), rejected.detach()


@PREFERENCE_LOSSES.register("hinge")
def hinge_loss(
    x: PreferenceInput, config: PreferenceLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SLiC's hinge on the scaled log-ratio margin."""
    chosen, rejected = _log_ratio_rewards(x, config.beta)
    return torch.relu(1 - (chosen - rejected)), chosen.detach(), rejected.detach()


@PREFERENCE_LOSSES.register("ipo")
def ipo_loss(
    x: PreferenceInput, config: PreferenceLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IPO: squared distance of the length-averaged log-ratio margin from ``1/(2β)``."""
    chosen = (x.policy_chosen - x.reference_chosen) / x.chosen_lengths
    rejected = (x.policy_rejected - x.reference_rejected) / x.rejected_lengths
    loss = (chosen - rejected - 1 / (2 * config.beta)) ** 2
    return loss, config.beta * chosen.detach(), config.beta * rejected.detach()


@PREFERENCE_LOSSES.register("simpo")
def simpo_loss(
    x: PreferenceInput, config: PreferenceLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO: reference-free, length-normalised log-probs, target margin γ (label smoothing as in cDPO)."""
    chosen = config.beta * x.policy_chosen / x.chosen_lengths
    rejected = config.beta * x.policy_rejected / x.rejected_lengths
    loss = _smoothed_logistic(chosen - rejected - config.gamma, config.label_smoothing)
    return loss, chosen.detach(), rejected.detach()


@PREFERENCE_LOSSES.register("bradley_terry")
def bradley_terry_loss(
    x: PreferenceInput, config: PreferenceLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Bradley–Terry logistic loss on the scaled score difference (label smoothing as in
    cDPO), reference-free: a reward model's loss when the scores are its outputs."""
    chosen, rejected = config.beta * x.policy_chosen, config.beta * x.policy_rejected
    loss = _smoothed_logistic(chosen - rejected, config.label_smoothing)
    return loss, chosen.detach(), rejected.detach()


def compute_preference_loss(
    x: PreferenceInput, config: PreferenceLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss [P], chosen rewards [P], rejected rewards [P])`` of the loss named in ``config``."""
    return PREFERENCE_LOSSES.get(config.name)(x, config)
