"""Variable-length causal attention for packed rows, registered with transformers' attention interface.

transformers' SDPA path handles a packed row by building a dense block-causal ``[T, T]``
mask, so its cost grows with the square of the *packed* length. This implementation runs
causal attention within each sequence (sequences bucketed by length, one call per bucket:
:func:`tandem.engine.causal_attention.causal_attention`): the cost is ``sum(len_i^2)``, as
with flash-attention's varlen kernel on GPU. Results equal the padded computation (tests
check 1e-5).

What a "sequence" is comes from an :class:`AttentionPlan`, built once per forward and passed
to every layer as the ``tandem_attention_plan`` keyword. A sequence lists the packed
positions it reads, in order; they need not be contiguous, and several sequences may read
the same positions. That is how rows sharing a prompt attend to one packed copy of it
(:mod:`tandem.engine.shared_prompts`): each row's sequence is its group's prompt followed
by its own response, and one row per group supplies the prompt's outputs. Without a plan,
the sequences are the contiguous spans of ``cu_seq_lens_q`` (flash-attention's varlen
argument).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from tandem.engine.causal_attention import causal_attention

VARLEN_ATTENTION = "tandem_varlen"
PLAN_KEYWORD = "tandem_attention_plan"


@dataclass(frozen=True)
class AttentionPlan:
    """How one packed row of ``T`` tokens is attended.

    Attributes:
        index: ``[M]`` the packed positions read by all sequences, bucket after bucket and
            sequence after sequence (each sequence right-padded to its bucket's length).
        buckets: ``(n, L)`` per bucket: ``n`` sequences padded to length ``L``; ``M = sum(n * L)``.
        select: ``[T]`` for each packed position, the row of the ``[M]`` outputs that holds
            its output (the sequence that owns the position).
    """

    index: torch.Tensor
    buckets: tuple[tuple[int, int], ...]
    select: torch.Tensor


def bucket_length(length: int) -> int:
    """``length`` rounded up to a multiple of 16, or of 1/8 of its power of two when longer
    (<= 12.5% padding): RL batches of ~100-token sequences run a handful of SDPA calls per
    layer instead of one per distinct length."""
    step = max(16, 1 << max(length.bit_length() - 4, 0))
    return -(-length // step) * step


def plan_sequences(
    sequences: Sequence[torch.Tensor], owned: Sequence[torch.Tensor], num_tokens: int
) -> AttentionPlan:
    """A plan from each sequence's packed positions ``sequences[s] [L_s]`` and a bool mask
    ``owned[s] [L_s]`` of the positions whose output it supplies (each of the ``num_tokens``
    packed positions must be owned exactly once).

    Padding a sequence at its end changes nothing for its real positions under causal
    attention (no real query sees a later key), and the padded rows own nothing, so their
    outputs are dropped and no gradient flows through them.
    """
    if [len(s) for s in sequences] != [len(o) for o in owned]:
        raise ValueError("each sequence needs an ownership mask of its own length")
    by_length: dict[int, list[int]] = defaultdict(list)
    for s, positions in enumerate(sequences):
        if len(positions):
            by_length[bucket_length(len(positions))].append(s)
    index, keep, buckets = [], [], []
    for length in sorted(by_length):
        members = by_length[length]
        for s in members:
            pad = length - len(sequences[s])
            index += [sequences[s], sequences[s][-1:].expand(pad)]
            keep += [owned[s], torch.zeros(pad, dtype=torch.bool)]
        buckets.append((len(members), length))
    if not buckets:
        empty = torch.zeros(0, dtype=torch.long)
        return AttentionPlan(empty, (), empty)
    index_all = torch.cat(index)
    kept_rows = torch.cat(keep).nonzero().flatten()  # rows of the [M] outputs that are kept
    kept_positions = index_all[kept_rows]
    if kept_positions.numel() != num_tokens or not torch.equal(
        kept_positions.sort().values, torch.arange(num_tokens)
    ):
        raise ValueError(f"the sequences must own each of the {num_tokens} packed positions exactly once")
    return AttentionPlan(index_all, tuple(buckets), kept_rows[torch.argsort(kept_positions)])


def contiguous_plan(cu_seqlens: torch.Tensor) -> AttentionPlan:
    """The plan of a plain packed row: sequence ``i`` is ``cu_seqlens[i]:cu_seqlens[i + 1]``."""
    bounds = cu_seqlens.tolist()
    sequences = [torch.arange(start, end) for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    return plan_sequences(sequences, [torch.ones(len(s), dtype=torch.bool) for s in sequences], bounds[-1])


def _sequences(tensor: torch.Tensor, plan: AttentionPlan) -> list[torch.Tensor]:
    """``tensor [1, H, T, D]`` gathered along the plan as one ``[n, H, L, D]`` tensor per bucket.

    One ``index_select`` over tokens and a split: their backward is one ``index_add`` and one
    concatenation, however many buckets there are (advanced indexing's backward, an
    accumulating ``index_put``, was 10x slower on CPU).
    """
    gathered = tensor.squeeze(0).transpose(0, 1).index_select(0, plan.index)  # [M, H, D]
    pieces = gathered.split([n * length for n, length in plan.buckets])
    return [
        piece.unflatten(0, bucket).transpose(1, 2) for piece, bucket in zip(pieces, plan.buckets, strict=True)
    ]


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    tandem_attention_plan: AttentionPlan | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each sequence of the plan (or of ``cu_seq_lens_q``).

    Shapes: ``query [1, H, T, D]``, ``key, value [1, H_kv, T, D]`` (grouped-query heads are
    shared), ``cu_seq_lens_q [n + 1]`` -> output ``[1, T, H, D]``.
    """
    plan = tandem_attention_plan
    if plan is None:
        if cu_seq_lens_q is None:
            raise ValueError(
                f"{VARLEN_ATTENTION} attention needs cu_seq_lens_q (the packed sequence boundaries) or {PLAN_KEYWORD}"
            )
        plan = contiguous_plan(cu_seq_lens_q)
    if query.shape[0] != 1:
        raise ValueError(f"{VARLEN_ATTENTION} attention expects one packed row, got batch {query.shape[0]}")
    dropout_p = dropout if module.training else 0.0
    pieces = [
        causal_attention(q, k, v, scaling, dropout_p)
        .transpose(1, 2)
        .flatten(0, 1)  # [n, H, L, D] -> [n * L, H, D]
        for q, k, v in zip(
            _sequences(query, plan), _sequences(key, plan), _sequences(value, plan), strict=True
        )
    ]
    # Put the owned rows back in packed order with one gather (its backward is one scatter).
    output = torch.cat(pieces).index_select(0, plan.select)
    return output.unsqueeze(0), None


AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa_attention)
