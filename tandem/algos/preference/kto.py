"""Unpaired losses (KTO): rows of prompt, completion and a desirable / undesirable label,
registered by name in ``UNPAIRED_LOSSES``.

Each row ``i`` has the summed completion log-probs ``π_i`` (policy) and ``ρ_i`` (reference),
``u_i = π_i - ρ_i``. KTO's reference point ``z`` is the batch's KL estimate from mismatched
(prompt, completion) pairs, ``z = max(0, mean(π'_j - ρ'_j))`` over the mismatched rows ``j``,
detached (:func:`kto_kl_estimate`).

=====================  ======================================================================
``kto``                desirable: ``λ_D (1 - σ(β(u - z)))``; undesirable: ``λ_U (1 - σ(β(z - u)))``
``apo_zero_unpaired``  desirable: ``λ_D (1 - σ(βu))``; undesirable: ``λ_U σ(βu)`` (no ``z``)
=====================  ======================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.registry import Registry

if TYPE_CHECKING:
    from tandem.algos.preference.config import PreferenceLossConfig


@dataclass(frozen=True)
class UnpairedInput:
    """``N`` rows: ``policy, reference [N]`` summed completion log-probs, ``desirable [N]`` bool,
    ``kl`` a 0-d detached tensor (KTO's reference point ``z``; 0 for losses without one)."""

    policy: torch.Tensor
    reference: torch.Tensor
    desirable: torch.Tensor
    kl: torch.Tensor


@dataclass(frozen=True)
class UnpairedOutput:
    """``loss [N]`` per row (the step's loss is its mean over rows) and ``rewards [N]``, ``β u`` detached."""

    loss: torch.Tensor
    rewards: torch.Tensor


UnpairedLoss = Callable[[UnpairedInput, "PreferenceLossConfig"], UnpairedOutput]
UNPAIRED_LOSSES: Registry[UnpairedLoss] = Registry("unpaired preference loss")
KL_BASELINE: set[str] = set()  # losses that read the mismatched rows' KL estimate


def register_unpaired_loss(name: str, *, kl_baseline: bool) -> Callable[[UnpairedLoss], UnpairedLoss]:
    """Register an unpaired loss; ``kl_baseline``: it reads :attr:`UnpairedInput.kl` (the
    trainer then scores the mismatched rows)."""

    def decorator(fn: UnpairedLoss) -> UnpairedLoss:
        UNPAIRED_LOSSES.register(name)(fn)
        if kl_baseline:
            KL_BASELINE.add(name)
        return fn

    return decorator


def kto_kl_estimate(policy: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """KTO's reference point from mismatched rows' summed log-probs ``[M]``: the mean log-ratio,
    clamped at 0, detached (0-d)."""
    return (policy - reference).mean().detach().clamp(min=0)


def _weighted(config: PreferenceLossConfig, desirable: torch.Tensor, good: torch.Tensor, bad: torch.Tensor):
    weights = torch.where(desirable, config.desirable_weight, config.undesirable_weight)
    return weights * torch.where(desirable, good, bad)


@register_unpaired_loss("kto", kl_baseline=True)
def kto_loss(x: UnpairedInput, config: PreferenceLossConfig) -> UnpairedOutput:
    """KTO: the prospect-theory value of each completion's log-ratio against the KL reference point."""
    log_ratio = x.policy - x.reference
    good = 1 - torch.sigmoid(config.beta * (log_ratio - x.kl))
    bad = 1 - torch.sigmoid(config.beta * (x.kl - log_ratio))
    return UnpairedOutput(_weighted(config, x.desirable, good, bad), config.beta * log_ratio.detach())


@register_unpaired_loss("apo_zero_unpaired", kl_baseline=False)
def apo_zero_unpaired_loss(x: UnpairedInput, config: PreferenceLossConfig) -> UnpairedOutput:
    """APO-zero on unpaired rows: raise desirable likelihoods, lower undesirable ones."""
    log_ratio = x.policy - x.reference
    good = 1 - torch.sigmoid(config.beta * log_ratio)
    bad = torch.sigmoid(config.beta * log_ratio)
    return UnpairedOutput(_weighted(config, x.desirable, good, bad), config.beta * log_ratio.detach())


def compute_unpaired_loss(x: UnpairedInput, config: PreferenceLossConfig) -> UnpairedOutput:
    """The unpaired loss named by ``config.name``."""
    return UNPAIRED_LOSSES.get(config.name)(x, config)
