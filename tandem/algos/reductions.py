"""Batch-wide statistics as named reductions, so that they can be reduced where the rows are.

A statistic over a step's batch (a mean over its valid tokens, a largest ratio) is written as
*terms*: ``{name: (op, values)}`` with ``op`` one of ``sum``, ``max``, ``min`` (over every
element of ``values [B, ...]``) or ``mean`` (of a per-row ``values [B]``), and a function of the
reduced terms. Reduced in one place (:func:`reduce_whole`), that is the statistic of a ``Batch``
the controller holds. Reduced where the rows live, each rank reduces its rows' entries to one
value per row (:func:`reduce_rows`: ``[b]`` per term, small per-row scalars), and the controller
reduces those rows (:func:`reduce_row_partials`). ``max``, ``min`` and ``mean`` come out bit for
bit the same either way; a ``sum`` adds the same numbers in another order (per row first), so it
may differ in its last bits.
"""

from __future__ import annotations

import torch

Terms = dict[str, tuple[str, torch.Tensor]]  # name -> (op, values [B, ...])
OPS = ("sum", "max", "min", "mean")


def reduce_whole(terms: Terms) -> dict[str, torch.Tensor]:
    """Each term reduced over every element: ``{name: 0-D tensor}``."""
    out = {}
    for name, (op, values) in terms.items():
        _check(name, op, values)
        out[name] = values.mean() if op == "mean" else getattr(values, _TORCH_OP[op])()
    return out


def reduce_rows(terms: Terms) -> dict[str, torch.Tensor]:
    """Each term reduced over all but its first dimension: ``{name: [B]}`` (a ``mean`` term's
    per-row values as they are)."""
    out = {}
    for name, (op, values) in terms.items():
        _check(name, op, values)
        out[name] = values if values.ndim == 1 else getattr(values.flatten(1), _TORCH_OP[op])(dim=1)
    return out


def reduce_row_partials(rows: dict[str, torch.Tensor], ops: dict[str, str]) -> dict[str, torch.Tensor]:
    """The per-row partials of :func:`reduce_rows` (``[B]`` each, every row of the batch) reduced
    over the rows with each term's ``ops[name]``: what :func:`reduce_whole` gives on the whole batch."""
    return {name: reduce_whole({name: (ops[name], rows[name])})[name] for name in ops}


def term_ops(terms: Terms) -> dict[str, str]:
    """``{name: op}`` of ``terms`` (what :func:`reduce_row_partials` needs beside the partials)."""
    return {name: op for name, (op, _) in terms.items()}


_TORCH_OP = {"sum": "sum", "max": "amax", "min": "amin", "mean": "mean"}


def _check(name: str, op: str, values: torch.Tensor) -> None:
    if op not in OPS:
        raise ValueError(f"term {name!r}: op {op!r} is not one of {list(OPS)}")
    if op == "mean" and values.ndim != 1:
        raise ValueError(f"term {name!r}: a mean term is per row ([B]), got shape {tuple(values.shape)}")
