"""Ulysses attention: the packed varlen attention over the whole row, with the sequence shard
traded for a head shard around it; registered with transformers' attention interface.

With ``engine.sp_size > 1`` the engine selects :data:`ULYSSES_ATTENTION` and passes the
forward's :class:`~tandem.engine.ulysses.SequenceParallel` as the ``tandem_sequence_parallel``
keyword (next to the attention plan, which describes the whole row). Each rank's decoder
layer projects queries, keys and values for its ``T / P`` tokens; here they become ``H / P``
heads over all ``T`` tokens, :func:`~tandem.engine.varlen_attention.packed_attention` runs
exactly as it does without sequence parallelism, and the outputs go back to ``T / P`` tokens
with every head, for the layer's output projection.

Grouped-query models with fewer key/value heads than ranks repeat each key/value head
``P / H_kv`` times first, so that every rank receives one whole head (the query heads it
holds all read that one).

Under tensor parallelism as well (``engine.tp_size = K``) the projections handed here are a
tensor-parallel rank's heads, ``H / K`` and ``H_kv / K``, and the all-to-alls run over that
rank's sequence-parallel group (the ranks with the same tensor-parallel rank): each rank
attends over the whole row with ``H / (K * P)`` query heads.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from tandem.engine.ulysses import SequenceParallel, all_to_all
from tandem.engine.varlen_attention import packed_attention

ULYSSES_ATTENTION = "tandem_ulysses"
SEQUENCE_PARALLEL_KEYWORD = "tandem_sequence_parallel"


def check_heads(heads: int, kv_heads: int, sp_size: int, tp_size: int = 1) -> None:
    """Raise ``ValueError`` unless ``heads`` query and ``kv_heads`` key/value heads split over
    ``sp_size`` ranks into whole heads (key/value heads repeated when fewer than the ranks).
    Under tensor parallelism (``tp_size > 1``, whose own split of the heads is checked first)
    each tensor-parallel rank's share, ``heads / tp_size`` and ``kv_heads / tp_size``, is split."""
    if tp_size > 1:
        _check_heads_of_tensor_parallel_rank(heads, kv_heads, sp_size, tp_size)
        return
    if heads % sp_size:
        raise ValueError(
            f"engine.sp_size={sp_size} must divide the model's num_attention_heads={heads}: "
            "each sequence-parallel rank attends with whole heads"
        )
    if kv_heads % sp_size and sp_size % kv_heads:
        raise ValueError(
            f"engine.sp_size={sp_size} and the model's num_key_value_heads={kv_heads}: one must divide "
            "the other (key/value heads are split over the ranks, or repeated until each rank has one)"
        )


def _check_heads_of_tensor_parallel_rank(heads: int, kv_heads: int, sp_size: int, tp_size: int) -> None:
    both = f"engine.sp_size={sp_size} x engine.tp_size={tp_size}"
    if heads % (sp_size * tp_size):
        raise ValueError(
            f"{both} = {sp_size * tp_size} must divide the model's num_attention_heads={heads}: each "
            "tensor-parallel rank projects heads / tp_size heads, which its sequence-parallel group "
            "splits into whole heads"
        )
    local = kv_heads // tp_size
    if local % sp_size and sp_size % local:
        raise ValueError(
            f"{both} and the model's num_key_value_heads={kv_heads}: each tensor-parallel rank holds "
            f"{local}, and engine.sp_size must divide that or be divisible by it (key/value heads are "
            "split over the sequence-parallel ranks, or repeated until each has one)"
        )


def _heads_over_row(tensor: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """``[1, heads, T / P, D]`` -> ``[1, heads / P, T, D]``, repeating heads when fewer than ``P``."""
    heads = tensor.shape[1]
    if heads < sp.size:
        tensor = tensor.repeat_interleave(sp.size // heads, dim=1)
    return all_to_all(tensor, sp.group, scatter_dim=1, gather_dim=2)


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    tandem_sequence_parallel: SequenceParallel | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Packed attention of a row split over a sequence-parallel group.

    Shapes: ``query [1, H, T / P, D]``, ``key, value [1, H_kv, T / P, D]`` (this rank's
    tokens) -> ``[1, T / P, H, D]``. The other arguments are
    :func:`~tandem.engine.varlen_attention.packed_attention`'s, for the whole row.
    """
    sp = tandem_sequence_parallel
    if sp is None:
        raise ValueError(f"{ULYSSES_ATTENTION} attention needs the {SEQUENCE_PARALLEL_KEYWORD} keyword")
    check_heads(query.shape[1], key.shape[1], sp.size)
    query, key, value = (_heads_over_row(tensor, sp) for tensor in (query, key, value))
    output, _ = packed_attention(module, query, key, value, attention_mask, **kwargs)  # [1, T, H / P, D]
    return all_to_all(output, sp.group, scatter_dim=1, gather_dim=2), None


AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
