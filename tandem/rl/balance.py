"""Balanced data-parallel order: every rank gets the same number of sequences and nearly the same tokens.

A ``DP_COMPUTE`` call gives rank ``r`` the ``r``-th equal slice of the batch, so with long
and short responses in one step one rank can get most of the tokens and the others wait for
it. :func:`balanced_rank_order` permutes the batch first (``trainer.balance_batch``, on by
default), as verl's ``balance_batch`` does. It moves whole prompt groups (the ``n``
responses of a prompt) when the groups divide evenly over the ranks, so a rank still packs
each of its prompts once (shared-prompt packing); otherwise it moves single sequences.
The order changes which rank computes a sequence, never a result.
"""

from __future__ import annotations

import torch

from tandem.engine.micro_batch import karmarkar_karp


def balanced_rank_order(attention_mask: torch.Tensor, group_size: int, world_size: int) -> list[int]:
    """A permutation of the ``B`` rows of ``attention_mask [B, S]`` whose ``world_size`` equal
    slices carry nearly equal token counts; rows ``g * group_size .. (g + 1) * group_size - 1``
    form group ``g`` and stay together when ``B / group_size`` divides by ``world_size``.
    """
    return balanced_order(attention_mask.sum(-1).tolist(), group_size, world_size)


def balanced_order(lengths: list[int], group_size: int, world_size: int) -> list[int]:
    """:func:`balanced_rank_order` of rows of ``lengths`` tokens each."""
    rows = len(lengths)
    if rows % world_size:
        raise ValueError(f"{rows} rows do not divide into {world_size} equal rank slices")
    if rows % group_size == 0 and (rows // group_size) % world_size == 0:
        group_tokens = [
            sum(lengths[g * group_size : (g + 1) * group_size]) for g in range(rows // group_size)
        ]
        parts = karmarkar_karp(group_tokens, world_size, equal_size=True)
        return [g * group_size + i for part in parts for g in part for i in range(group_size)]
    parts = karmarkar_karp(lengths, world_size, equal_size=True)
    return [row for part in parts for row in part]
