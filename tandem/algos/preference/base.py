"""What every paired preference loss shares: its input, its output, its registry, and the
f-divergence scores and NLL term several losses build on.

Notation: ``π_c, π_r`` the policy's summed response log-probs of chosen / rejected, ``ρ_c, ρ_r``
the reference's, ``u_c = π_c - ρ_c`` and ``u_r = π_r - ρ_r`` the log-ratios, ``β`` the inverse
temperature, ``σ`` the logistic function.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.registry import Registry

if TYPE_CHECKING:
    from tandem.algos.preference.config import PreferenceLossConfig


@dataclass(frozen=True)
class PreferenceInput:
    """One batch of ``P`` pairs, every tensor ``[P]`` and fp32.

    Attributes:
        policy_chosen / policy_rejected: summed response log-probs under the policy (with LD-DPO's
            ``ld_alpha``, the desensitised sums: see :mod:`tandem.dpo.loss`).
        reference_chosen / reference_rejected: the same under the reference (zeros for a
            reference-free loss).
        chosen_lengths / rejected_lengths: response lengths in tokens.
        mean_chosen_length: the step's chosen tokens per pair (all micro-batches and ranks
            together); the NLL terms (``sft``, RPO, CPO, ORPO) divide each pair's ``-π_c`` by it,
            so that their mean over the step's pairs is the per-token mean NLL. None: the mean of
            ``chosen_lengths``.
        chosen_weights / rejected_weights: WPO's detached per-response weights (``use_weighting``),
            None otherwise.
    """

    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    reference_chosen: torch.Tensor
    reference_rejected: torch.Tensor
    chosen_lengths: torch.Tensor
    rejected_lengths: torch.Tensor
    mean_chosen_length: float | None = None
    chosen_weights: torch.Tensor | None = None
    rejected_weights: torch.Tensor | None = None


@dataclass(frozen=True)
class PreferenceOutput:
    """A loss's per-pair values.

    Attributes:
        loss: ``[P]``, the per-pair loss (the step's loss is its mean over pairs).
        chosen_rewards / rejected_rewards: ``[P]`` detached implicit rewards (``rewards/*``).
        metrics: extra ``[P]`` detached per-pair values by TRL's name (``nll_loss``,
            ``log_odds_ratio``, ...); the trainer reports their mean over pairs.
    """

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


PreferenceLoss = Callable[[PreferenceInput, "PreferenceLossConfig"], PreferenceOutput]
PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry("preference loss")
REFERENCE_FREE: set[str] = set()  # filled by register_preference_loss
F_DIVERGENCE_LOSSES: set[str] = set()  # losses of the margin u_c - u_r, which f-DPO generalises


def register_preference_loss(
    name: str, *, reference_free: bool = False, f_divergence: bool = False
) -> Callable[[PreferenceLoss], PreferenceLoss]:
    """Register a paired loss under ``name``; ``reference_free``: it reads no reference
    log-probs (the trainer loads no reference); ``f_divergence``: it is a function of the margin
    of log-ratio scores, so ``f_divergence_type`` may change the scores."""

    def decorator(fn: PreferenceLoss) -> PreferenceLoss:
        PREFERENCE_LOSSES.register(name)(fn)
        if reference_free:
            REFERENCE_FREE.add(name)
        if f_divergence:
            F_DIVERGENCE_LOSSES.add(name)
        return fn

    return decorator


def smoothed_logistic(logits: torch.Tensor, eps: float) -> torch.Tensor:
    """``-(1-ε) log σ(z) - ε log σ(-z)``: the logistic loss with label smoothing ε, ``[P]``."""
    return -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)


def log_ratio_rewards(x: PreferenceInput, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(β u_c, β u_r)``, each ``[P]`` (with gradients)."""
    return beta * (x.policy_chosen - x.reference_chosen), beta * (x.policy_rejected - x.reference_rejected)


def f_divergence_score(log_ratio: torch.Tensor, kind: str, alpha: float) -> torch.Tensor:
    """``f'(t)`` at ``t = π/ρ = exp(log_ratio)`` for the f-divergence ``kind`` (f-DPO), ``[P]``.

    ``reverse_kl``: ``log t`` (DPO); ``forward_kl``: ``1 - 1/t``; ``js_divergence``:
    ``log(2t/(t+1)) = log 2 + log σ(log t)``; ``alpha_divergence``: ``(t^(α-1) - 1)/(α-1)``
    (``α = 1`` is the reverse KL's limit). The α-divergence's exponent is clamped at 80, as in
    TRL, so that ``exp`` stays finite in fp32.
    """
    if kind == "reverse_kl":
        return log_ratio
    if kind == "forward_kl":
        return 1 - torch.exp(-log_ratio)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(log_ratio)
    if kind == "alpha_divergence":
        if abs(alpha - 1.0) < 1e-6:
            return log_ratio
        exponent = torch.clamp((alpha - 1.0) * log_ratio, max=80.0)
        return (torch.exp(exponent) - 1.0) / (alpha - 1.0)
    raise ValueError(f"unknown f-divergence {kind!r}")


def f_scores(x: PreferenceInput, config: PreferenceLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected scores ``f'(π/ρ)`` ``[P]`` under ``config.f_divergence_type``."""
    kind, alpha = config.f_divergence_type, config.f_alpha_divergence_coef
    return (
        f_divergence_score(x.policy_chosen - x.reference_chosen, kind, alpha),
        f_divergence_score(x.policy_rejected - x.reference_rejected, kind, alpha),
    )


def chosen_nll(x: PreferenceInput) -> torch.Tensor:
    """Each pair's share ``[P]`` of the per-token NLL of the chosen responses: ``-π_c`` over the
    step's chosen tokens per pair (their mean over the step's pairs is the token mean)."""
    length = x.mean_chosen_length if x.mean_chosen_length is not None else x.chosen_lengths.mean()
    return -x.policy_chosen / length
