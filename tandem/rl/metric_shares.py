"""How the update's metrics are reduced over micro-batches, ranks and optimizer steps.

A loss function reports each per-token mean as its micro-batch's **share** of the mini-batch's
mean over all data-parallel ranks: the micro-batch's mean times its valid tokens over the
mini-batch's (:func:`as_shares`; a per-row mean weighs by rows instead), the way the loss
itself is a share (:mod:`tandem.algos.aggregation`). Shares add up over micro-batches and ranks
to one mean over the mini-batch's tokens, so ``actor/entropy``, ``actor/pg_clipfrac``,
``actor/ppo_kl`` do not depend on how the mini-batch is split (verl instead averages its
micro-batches' own means, equal only when they hold as many tokens). Each optimizer step's value
is then averaged over the optimizer steps (mini-batches and epochs).
"""

from __future__ import annotations

import torch

from tandem.algos import LossNormalizer

MAX_METRICS = ("rollout_corr/max_abs_log_prob_diff",)  # the largest over micro-batches and ranks
STEP_METRICS = (
    "actor/grad_norm",
    "actor/lr",
    "actor/skipped_updates",
    "actor/skipped_updates_in_a_row",
    "critic/grad_norm",
    "critic/lr",
    "critic/skipped_updates_in_a_row",
)  # one value per optimizer step, alike on every rank: averaged
MEAN_PREFIXES = ("moe/",)  # the engine's routing metrics: each micro-batch's own mean, averaged
ROW_MEAN_METRICS = ("rollout_corr/ppl_ratio",)  # a mean over the rows with valid tokens, not the tokens


def as_shares(
    metrics: dict[str, torch.Tensor],
    response_mask: torch.Tensor,
    normalizer: LossNormalizer,
    already_shares: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """``metrics`` (0-D means over the valid tokens of ``response_mask [B, R]``) as shares of the
    mini-batch's means over all ranks: times this micro-batch's valid tokens over
    ``normalizer.num_tokens`` (rows with tokens over ``num_seqs`` for :data:`ROW_MEAN_METRICS`),
    in float64. ``already_shares`` (loss shares) and :data:`MAX_METRICS` pass unchanged."""
    mask = response_mask.to(torch.float64)
    tokens = mask.sum() / max(normalizer.num_tokens, 1.0)
    rows = (mask.sum(-1) > 0).sum().to(torch.float64) / max(normalizer.num_seqs, 1.0)
    shares = {}
    for name, value in metrics.items():
        if name in already_shares or name in MAX_METRICS:
            shares[name] = value
        else:
            shares[name] = value.to(torch.float64) * (rows if name in ROW_MEAN_METRICS else tokens)
    return shares


def reduce_metric(name: str, values: list[float], over_steps: bool = False) -> float:
    """Combine one metric's values from the micro-batches (or ranks) of one optimizer step:
    maxima take the max; per-step values (:data:`STEP_METRICS`) and ``moe/*`` means average;
    every other metric is a share (a loss share, or a mean made one by :func:`as_shares`) and
    adds up. Over optimizer steps (``over_steps``) every metric averages (maxima take the max)."""
    if name in MAX_METRICS or name.startswith("perf/max_memory"):
        return max(values)
    if over_steps or name in STEP_METRICS or name.startswith(MEAN_PREFIXES):
        return sum(values) / len(values)
    return sum(values)
