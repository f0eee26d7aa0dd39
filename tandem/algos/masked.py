"""Masked reductions and per-group statistics used by the estimators and losses.

All functions are pure and device-agnostic; none syncs with the host.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1 (over ``dim`` or everything)."""
    masked = values * mask
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1; an all-zero mask gives 0 rather than NaN."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries (Bessel-corrected when ``unbiased``); 0 with fewer than 2 entries."""
    mean = masked_mean(values, mask)
    count = mask.sum()
    sq = masked_sum((values - mean) ** 2, mask)
    denom = (count - 1) if unbiased else count
    return torch.where(count > 1, sq / denom.clamp(min=1), torch.zeros_like(sq))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Normalise to zero mean and unit variance over the masked entries: ``(x - mean) / sqrt(var + eps)``."""
    return whiten_with(values, masked_mean(values, mask), masked_var(values, mask), eps)


def whiten_with(
    values: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` with given 0-D statistics (:func:`masked_whiten`'s, or
    :func:`whitening_stats` reduced where the rows live)."""
    return (values - mean) * torch.rsqrt(var + eps)


def whitening_terms(values: torch.Tensor, mask: torch.Tensor) -> dict[str, tuple[str, torch.Tensor]]:
    """The sums :func:`whitening_stats` needs of the masked entries of ``values [B, ...]``, in float64
    (:mod:`tandem.algos.reductions` terms): their count, their sum and their sum of squares."""
    mask = mask.to(torch.float64)
    values = values.to(torch.float64) * mask
    return {"count": ("sum", mask), "total": ("sum", values), "squares": ("sum", values.square())}


def whitening_stats(
    reduced: dict[str, torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and unbiased variance (0 with fewer than 2 entries) of the entries whose
    :func:`whitening_terms` were reduced to ``reduced``, as 0-D ``dtype`` tensors. One pass over
    float64 sums (``(squares - total * mean) / (count - 1)``), where :func:`masked_var` takes two
    passes in the values' dtype: the two agree to about the values' rounding."""
    count, total = reduced["count"], reduced["total"]
    mean = total / count.clamp(min=1)
    squares = (reduced["squares"] - total * mean).clamp(min=0)
    var = torch.where(count > 1, squares / (count - 1).clamp(min=1), torch.zeros_like(squares))
    return mean.to(dtype), var.to(dtype)


def compact_group_ids(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary int group ids ``[B]`` to ``0..G-1``; returns ``(ids [B], G)``."""
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(unique.numel())


def group_sum(values: torch.Tensor, ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group sums: ``values [B]``, compact ``ids [B]`` -> ``[G]``."""
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, ids, values)


def group_stats(
    values: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, mean and unbiased std of ``values [B]`` within its group.

    Returns three ``[B]`` tensors: ``count``, ``mean`` and ``std`` (std is 0 for groups of one).
    """
    ids, num_groups = compact_group_ids(group_ids)
    count = group_sum(torch.ones_like(values), ids, num_groups)
    mean = group_sum(values, ids, num_groups) / count
    sq = group_sum((values - mean[ids]) ** 2, ids, num_groups)
    std = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.zeros_like(sq)).sqrt()
    return count[ids], mean[ids], std[ids]
