"""Which rows of a batch each micro-batch of a step takes.

With packing, micro-batches hold at most ``max_tokens_per_micro_batch`` real tokens
(:func:`~tandem.engine.micro_batch.token_budget_micro_batches`); the rows of a shared prompt stay
together and count the prompt once. Without it, ``micro_batch_size`` rows each. Rows that share
a ``micro_batch_unit`` id (a preference pair's two responses) always share a micro-batch. Every
rank must run the same number of forwards (FSDP2 gathers parameters in each, a
sequence-parallel group exchanges activations in each), so the count is agreed over the ranks
and a rank with fewer rows runs empty micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.micro_batch import token_budget_micro_batches
from tandem.engine.shared_prompts import prompt_groups
from tandem.engine.vision_inputs import IMAGES_FIELD
from tandem.protocol import Batch

UNIT_FIELD = "micro_batch_unit"  # [B] ids: rows with one id are never split across micro-batches


def plan_micro_batches(
    batch: Batch, config: EngineConfig, shares_prompts: bool, agree_on_count: Callable[[int], int]
) -> list[list[int]]:
    """Row index lists of ``batch``'s micro-batches on this rank.

    ``shares_prompts``: the rows' prompts are packed once per group (``batch["prompts"]`` gives
    their width). ``agree_on_count(n)``: the largest ``n`` over the ranks (a collective), which
    every rank's plan then has.
    """
    attention_mask = batch["attention_mask"]
    lengths = attention_mask.sum(-1).tolist()
    units = row_units(batch[UNIT_FIELD]) if UNIT_FIELD in batch else None
    if config.use_packing:
        groups = None
        shared = [0] * len(lengths)
        if shares_prompts:  # keep each prompt's rows together, counting the prompt once
            width = batch["prompts"].shape[1]
            shared = attention_mask[:, :width].sum(-1).tolist()
            groups = [
                (rows, shared[rows[0]])
                for rows in prompt_groups(batch["input_ids"], attention_mask, width, batch.get(IMAGES_FIELD))
            ]
        if units is not None:  # rows that must share a micro-batch (a shared prompt counted once)
            groups = [(rows, min(shared[row] for row in rows)) for rows in units]
        budget, split = config.max_tokens_per_micro_batch, units is None
        parts = token_budget_micro_batches(lengths, budget, groups=groups, split_groups=split)
        count = agree_on_count(len(parts))
        if count != len(parts):
            parts = token_budget_micro_batches(
                lengths, budget, min_parts=count, groups=groups, split_groups=split
            )
        return parts
    size = config.micro_batch_size
    if units is not None:
        parts = whole_units_per_chunk(units, size)
        parts += [[] for _ in range(agree_on_count(len(parts)) - len(parts))]
        return parts
    count = agree_on_count(math.ceil(len(lengths) / size))
    return [list(range(start, min(start + size, len(lengths)))) for start in range(0, count * size, size)]


def row_units(ids: torch.Tensor) -> list[list[int]]:
    """Row indices grouped by equal ``ids`` (groups in order of first appearance)."""
    units: dict[int, list[int]] = {}
    for row, unit in enumerate(ids.tolist()):
        units.setdefault(unit, []).append(row)
    return list(units.values())


def whole_units_per_chunk(units: list[list[int]], size: int) -> list[list[int]]:
    """Fixed-size micro-batches of up to ``size`` rows made of whole units (a unit larger than
    ``size`` gets a micro-batch of its own)."""
    parts: list[list[int]] = [[]]
    for unit in units:
        if parts[-1] and len(parts[-1]) + len(unit) > size:
            parts.append([])
        parts[-1].extend(unit)
    return [sorted(part) for part in parts if part]
