"""``compute_preference_loss``: the configured paired losses, weighted and summed per pair,
with WPO's pair weights and RPO's NLL term."""

from __future__ import annotations

import torch

from tandem.algos.preference.base import PREFERENCE_LOSSES, PreferenceInput, PreferenceOutput, chosen_nll
from tandem.algos.preference.config import PreferenceLossConfig


def compute_preference_loss(x: PreferenceInput, config: PreferenceLossConfig) -> PreferenceOutput:
    """Per pair ``[P]``: ``Σ_k w_k L_k`` over ``config.losses`` (each ``L_k`` times WPO's
    ``w_c w_r`` with ``use_weighting``), plus ``rpo_alpha`` times the chosen NLL.

    The rewards are the first loss's; the metrics every loss reports are merged (an ``sft`` or
    ``cpo`` NLL and RPO's are the same number, ``nll_loss``; it is 0 only when no term adds it).
    """
    pair_weights = None
    if config.use_weighting:
        if x.chosen_weights is None or x.rejected_weights is None:
            raise ValueError("preference.use_weighting needs the WPO weights of both responses in the input")
        pair_weights = x.chosen_weights * x.rejected_weights
    total: torch.Tensor | None = None
    first: PreferenceOutput | None = None
    metrics: dict[str, torch.Tensor] = {}
    for name, weight in config.losses:
        output = PREFERENCE_LOSSES.get(name)(x, config)
        loss = output.loss if pair_weights is None else output.loss * pair_weights
        total = weight * loss if total is None else total + weight * loss
        first = first or output
        for name, value in output.metrics.items():
            # every loss that reports nll_loss reports the same chosen NLL (>= 0), or 0 where it adds
            # none (cpo with cpo_alpha=0, as TRL logs it): the NLL wins, whatever the order
            metrics[name] = (
                torch.maximum(metrics[name], value) if name == "nll_loss" and name in metrics else value
            )
    assert total is not None and first is not None  # config.losses is never empty
    if config.rpo_alpha:
        nll = chosen_nll(x)
        total = total + config.rpo_alpha * nll
        metrics["nll_loss"] = nll.detach()
    return PreferenceOutput(total, first.chosen_rewards, first.rejected_rewards, metrics)
