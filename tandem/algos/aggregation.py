"""Loss aggregation: turn a per-token loss ``[B, R]`` into a scalar, split-invariantly.

Every mode divides by a *global* count (tokens or sequences of the whole step's batch,
across all micro-batches and data-parallel ranks). Each micro-batch therefore returns its
share of the global loss, and summing the micro-batch results (gradient accumulation) and
summing over ranks gives exactly the full-batch value. A DDP-style all-reduce *averages*
gradients, so an engine using one multiplies each rank's loss by the world size.

``token-sum`` divides by nothing: micro-batch and rank sums add up to the global sum as they
are, and the engine's world-size scaling turns the DDP average back into that sum.

When the global counts are not given, the local ones are used: the result is then the
plain loss of this batch alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from tandem.algos.masked import masked_sum

LossAggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


@dataclass(frozen=True)
class LossNormalizer:
    """Global counts a micro-batch's loss is divided by.

    Attributes:
        num_tokens: valid (mask=1) tokens in the whole step's batch.
        num_seqs: sequences with at least one valid token in the whole step's batch.
    """

    num_tokens: float
    num_seqs: float

    @staticmethod
    def from_mask(response_mask: torch.Tensor) -> LossNormalizer:
        """Counts of one ``[B, R]`` mask; sum these over micro-batches and ranks for the global ones."""
        return LossNormalizer(
            num_tokens=float(response_mask.sum()),
            num_seqs=float((response_mask.sum(-1) > 0).sum()),
        )

    def __add__(self, other: LossNormalizer) -> LossNormalizer:
        return LossNormalizer(self.num_tokens + other.num_tokens, self.num_seqs + other.num_seqs)


def aggregate_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    normalizer: LossNormalizer | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into this batch's share of the global scalar loss.

    Args:
        loss_mat: ``[B, R]`` per-token loss.
        response_mask: ``[B, R]`` 1 where the token counts.
        mode: one of ``LOSS_AGG_MODES``:
            ``token-mean``: sum over all valid tokens / global token count (DAPO);
            ``token-sum``: sum over all valid tokens, not divided by any count;
            ``seq-mean-token-sum``: per-sequence token sum, averaged over global sequences;
            ``seq-mean-token-mean``: per-sequence token mean, averaged over global sequences (GRPO paper);
            ``seq-mean-token-sum-norm``: per-sequence token sum / ``norm_length``, averaged over
            global sequences (Dr. GRPO, arXiv:2503.20783: a constant replaces the length).
        normalizer: global counts; ``None`` uses this batch's own.
        norm_length: the constant of ``seq-mean-token-sum-norm``; defaults to ``R``.

    Returns:
        0-D tensor.
    """
    mask = response_mask.to(loss_mat.dtype)
    if normalizer is None:  # local counts, kept as tensors so nothing syncs with the host
        num_tokens = mask.sum().clamp(min=1)
        num_seqs = (mask.sum(-1) > 0).sum().to(loss_mat.dtype).clamp(min=1)
    else:
        num_tokens = max(normalizer.num_tokens, 1.0)
        num_seqs = max(normalizer.num_seqs, 1.0)
    if mode == "token-mean":
        return masked_sum(loss_mat, mask) / num_tokens
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)
    seq_sums = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return (seq_sums / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        length = float(loss_mat.shape[-1]) if norm_length is None else float(norm_length)
        return seq_sums.sum() / (num_seqs * length)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {list(LOSS_AGG_MODES)}")
