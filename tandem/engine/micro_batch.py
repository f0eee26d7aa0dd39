"""Token-budget micro-batches and balanced partitions (Karmarkar-Karp largest differencing).

Instead of a fixed number of sequences per micro-batch, a micro-batch holds at most
``max_tokens`` valid tokens; the sequences are partitioned so the micro-batches carry
nearly equal token counts (which also balances work across data-parallel ranks).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def karmarkar_karp(weights: Sequence[int], parts: int, equal_size: bool = False) -> list[list[int]]:
    """Partition item indices into ``parts`` sets of nearly equal total weight.

    The k-way largest differencing method (Karmarkar & Karp 1982): every item starts as a
    k-tuple of subsets, and the two tuples with the largest spread are merged (largest
    subset with smallest) until one remains. With ``equal_size`` the items are first taken
    in rounds of ``parts`` so every set gets the same number of items (needs
    ``len(weights) % parts == 0``).

    Returns:
        ``parts`` lists of indices, each sorted; sets are ordered by decreasing total weight.
    """
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    if equal_size and len(weights) % parts:
        raise ValueError(f"equal_size needs the {len(weights)} items to divide into {parts} parts")
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    # A state is (spread, tiebreak, [(sum, indices) x parts]) with subsets sorted by decreasing sum.
    heap: list = []
    if equal_size:
        groups = [order[start : start + parts] for start in range(0, len(order), parts)]
    else:
        groups = [[i] for i in order]
    for tiebreak, group in enumerate(groups):
        subsets = [(weights[i], [i]) for i in group] + [(0, []) for _ in range(parts - len(group))]
        subsets.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(subsets[0][0] - subsets[-1][0]), tiebreak, subsets))
    tiebreak = len(groups)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second), strict=True)]
        merged.sort(key=lambda s: -s[0])
        tiebreak += 1
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tiebreak, merged))
    if not heap:
        return [[] for _ in range(parts)]
    return [sorted(indices) for _, indices in heap[0][2]]


def token_budget_micro_batches(
    lengths: Sequence[int],
    max_tokens: int,
    min_parts: int = 1,
    groups: Sequence[tuple[Sequence[int], int]] | None = None,
    split_groups: bool = True,
) -> list[list[int]]:
    """Split sequences into the fewest balanced micro-batches (at least ``min_parts``) of at most ``max_tokens`` each.

    ``groups`` (optional) lists ``(rows, shared)``: rows whose first ``shared`` tokens are
    one packed copy (a shared prompt, :mod:`tandem.engine.shared_prompts`). A group costs
    ``shared + sum(lengths[row] - shared)`` tokens and stays in one micro-batch unless that
    exceeds the budget, when its rows are placed one by one (``split_groups``) or, for groups
    whose loss needs them together (a preference pair), an error names them. Every row must be
    in one group.

    Raises ``ValueError`` naming the sequence when one alone is longer than the budget.
    Empty micro-batches can appear only when ``min_parts`` exceeds the number of sequences.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    for index, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(
                f"sequence {index} has {length} tokens, more than the micro-batch token budget of {max_tokens}; "
                "raise the budget or truncate the data"
            )
    units = _placement_units(lengths, max_tokens, groups, split_groups)
    weights = [cost for _, cost in units]
    parts = max(min_parts, math.ceil(sum(weights) / max_tokens), 1)
    while True:
        split = karmarkar_karp(weights, parts)
        if all(sum(weights[u] for u in part) <= max_tokens for part in split):
            return [sorted(row for u in part for row in units[u][0]) for part in split]
        parts += 1


def _placement_units(
    lengths: Sequence[int],
    max_tokens: int,
    groups: Sequence[tuple[Sequence[int], int]] | None,
    split_groups: bool = True,
) -> list[tuple[list[int], int]]:
    """``(rows, tokens)`` placed together: each group within the budget, else single rows."""
    if groups is None:
        return [([row], length) for row, length in enumerate(lengths)]
    units: list[tuple[list[int], int]] = []
    for rows, shared in groups:
        cost = shared + sum(lengths[row] - shared for row in rows)
        if cost <= max_tokens:
            units.append((list(rows), cost))
        elif not split_groups:
            raise ValueError(
                f"sequences {list(rows)} must share a micro-batch but need {cost} tokens, more than the "
                f"micro-batch token budget of {max_tokens}; raise the budget or shorten the data"
            )
        else:
            units.extend(([row], lengths[row]) for row in rows)
    if sorted(row for rows, _ in units for row in rows) != list(range(len(lengths))):
        raise ValueError(f"groups must hold each of the {len(lengths)} rows exactly once")
    return units


def balanced_dp_order(lengths: Sequence[int], world_size: int) -> list[int]:
    """A permutation of the samples such that chunking it into ``world_size`` equal parts balances tokens.

    Feed ``batch.reorder(order)`` to a ``DP_COMPUTE`` call: rank ``r`` receives part ``r``, and
    every part has the same number of samples and nearly the same number of tokens
    (Karmarkar-Karp with equal-size parts). Needs ``len(lengths) % world_size == 0`` (pad first).
    """
    parts = karmarkar_karp(lengths, world_size, equal_size=True)
    return [index for part in parts for index in part]
