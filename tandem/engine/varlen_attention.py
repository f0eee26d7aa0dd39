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
by its own response, one row per group supplies the prompt's outputs, and the other rows
compute queries for their response tokens only (the prompt's keys and values are read, its
queries not recomputed: with ``n`` responses per prompt that drops ``n - 1`` of every ``n``
prompt query rows from the attention's products). Without a plan,
the sequences are the contiguous spans of ``cu_seq_lens_q`` (flash-attention's varlen
argument).
"""

from __future__ import annotations

import collections
import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from tandem.device import to_device
from tandem.engine.causal_attention import QueryOffsets, causal_attention
from tandem.kernels.cuda.varlen import VarlenKernel, varlen_kernel_for

VARLEN_ATTENTION = "tandem_varlen"
PLAN_KEYWORD = "tandem_attention_plan"
ROUTES: collections.Counter[str] = collections.Counter()  # calls per route (a kernel provider, or bucketed)


@dataclass(frozen=True)
class VarlenLayout:
    """The plan's sequences unpadded, one after another: flash-attention's varlen layout.

    Attributes:
        key_index: ``[K]`` the packed positions read as keys, sequence after sequence.
        query_index: ``[Q]`` the packed positions of the queries (each sequence's last ones).
        cu_keys, cu_queries: ``[n + 1]`` int32 cumulative key and query counts.
        max_keys, max_queries: the longest sequence's key and query counts.
        select: ``[T]`` for each packed position, the row of the ``[Q]`` outputs that holds it.
        contiguous: the keys and queries are positions ``0 .. T-1`` in order (a plain packed
            row): no gather is needed.
    """

    key_index: torch.Tensor
    query_index: torch.Tensor
    cu_keys: torch.Tensor
    cu_queries: torch.Tensor
    max_keys: int
    max_queries: int
    select: torch.Tensor
    contiguous: bool

    def to(self, device: torch.device) -> VarlenLayout:
        return dataclasses.replace(
            self,
            key_index=to_device(self.key_index, device),
            query_index=to_device(self.query_index, device),
            cu_keys=to_device(self.cu_keys, device),
            cu_queries=to_device(self.cu_queries, device),
            select=to_device(self.select, device),
        )


def varlen_layout(sequences: Sequence[torch.Tensor], query_counts: Sequence[int]) -> VarlenLayout:
    """The layout of ``sequences[s] [L_s]`` (packed positions) computing queries at their last
    ``query_counts[s]`` positions; sequences with no query are left out. The queries must
    cover each packed position exactly once (as :func:`plan_sequences` checks)."""
    kept = [(keys, count) for keys, count in zip(sequences, query_counts, strict=True) if count]
    empty = torch.zeros(0, dtype=torch.long)
    key_index = torch.cat([keys for keys, _ in kept]) if kept else empty
    query_index = torch.cat([keys[len(keys) - count :] for keys, count in kept]) if kept else empty

    def cumulative(counts: list[int]) -> torch.Tensor:
        return torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    key_counts, query_counts_kept = [len(keys) for keys, _ in kept], [count for _, count in kept]
    total = len(query_index)
    return VarlenLayout(
        key_index=key_index,
        query_index=query_index,
        cu_keys=cumulative(key_counts),
        cu_queries=cumulative(query_counts_kept),
        max_keys=max(key_counts, default=0),
        max_queries=max(query_counts_kept, default=0),
        select=torch.argsort(query_index),
        contiguous=len(key_index) == total and torch.equal(key_index, torch.arange(total))
        and torch.equal(query_index, key_index),
    )


@dataclass(frozen=True)
class AttentionPlan:
    """How one packed row of ``T`` tokens is attended.

    A sequence reads some packed positions as keys and computes queries at the last of them
    (all of them, unless it shares a prompt that another sequence computes). Sequences are
    bucketed by padded (query, key) lengths.

    Attributes:
        index: ``[M_k]`` the packed positions read as keys, bucket after bucket and sequence
            after sequence (each sequence right-padded to its bucket's key length).
        query_index: ``[M_q]`` the packed positions of the queries, laid out the same way.
        buckets: ``(n, L_q, L_k)`` per bucket: ``n`` sequences with queries padded to ``L_q``
            and keys to ``L_k``; ``M_q = sum(n * L_q)``, ``M_k = sum(n * L_k)``.
        offsets: per bucket, ``None`` when every query sits at its own index among the keys
            (``L_q == L_k``), else where each sequence's queries start among its keys.
        select: ``[T]`` for each packed position, the row of the ``[M_q]`` outputs that holds
            its output.
        varlen: the same sequences unpadded, for flash-attention's varlen kernel.
    """

    index: torch.Tensor
    query_index: torch.Tensor
    buckets: tuple[tuple[int, int, int], ...]
    offsets: tuple[QueryOffsets | None, ...]
    select: torch.Tensor
    varlen: VarlenLayout

    def to(self, device: torch.device) -> AttentionPlan:
        """The plan with its index tensors on ``device`` (plans are built on the CPU)."""
        return dataclasses.replace(
            self,
            index=to_device(self.index, device),
            query_index=to_device(self.query_index, device),
            select=to_device(self.select, device),
            varlen=self.varlen.to(device),
        )

    def with_fillers(self, count: int) -> AttentionPlan:
        """The plan of the row with ``count`` filler tokens appended: they are read by no
        query and take their output from row 0."""
        return dataclasses.replace(
            self,
            select=torch.cat([self.select, self.select.new_zeros(count)]),
            varlen=dataclasses.replace(
                self.varlen, select=torch.cat([self.varlen.select, self.varlen.select.new_zeros(count)])
            ),
        )


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
    ``owned[s] [L_s]`` of the positions whose output it supplies: a suffix of the sequence
    (its queries), ``L_s`` positions or fewer. Each of the ``num_tokens`` packed positions
    must be owned exactly once.

    Padding a sequence's keys and queries at their ends changes nothing for its real
    queries under causal attention (no real query sees a later key), and the padded query
    rows own nothing, so their outputs are dropped and no gradient flows through them.
    """
    if [len(s) for s in sequences] != [len(o) for o in owned]:
        raise ValueError("each sequence needs an ownership mask of its own length")
    by_lengths: dict[tuple[int, int], list[int]] = defaultdict(list)
    query_counts = []
    for s, mask in enumerate(owned):
        count = int(mask.sum())
        if count and not bool(mask[len(mask) - count :].all()):
            raise ValueError(f"sequence {s} must own a suffix of its positions (its queries)")
        query_counts.append(count)
        if count:
            by_lengths[(bucket_length(count), bucket_length(len(mask)))].append(s)
    index, query_index, keep, buckets, offsets = [], [], [], [], []
    for q_len, k_len in sorted(by_lengths):
        members = by_lengths[(q_len, k_len)]
        starts = []
        for s in members:
            keys, count = sequences[s], query_counts[s]
            queries = keys[len(keys) - count :]
            index += [keys, keys[-1:].expand(k_len - len(keys))]
            query_index += [queries, queries[-1:].expand(q_len - count)]
            keep += [torch.ones(count, dtype=torch.bool), torch.zeros(q_len - count, dtype=torch.bool)]
            starts.append(len(keys) - count)
        buckets.append((len(members), q_len, k_len))
        plain = q_len == k_len and not any(starts)
        offsets.append(None if plain else QueryOffsets(torch.tensor(starts)))
    layout = varlen_layout(sequences, query_counts)
    if not buckets:
        empty = torch.zeros(0, dtype=torch.long)
        return AttentionPlan(empty, empty, (), (), empty, layout)
    query_all = torch.cat(query_index)
    kept_rows = torch.cat(keep).nonzero().flatten()  # rows of the [M_q] outputs that are kept
    kept_positions = query_all[kept_rows]
    if kept_positions.numel() != num_tokens or not torch.equal(
        kept_positions.sort().values, torch.arange(num_tokens)
    ):
        raise ValueError(f"the sequences must own each of the {num_tokens} packed positions exactly once")
    return AttentionPlan(
        torch.cat(index),
        query_all,
        tuple(buckets),
        tuple(offsets),
        kept_rows[torch.argsort(kept_positions)],
        layout,
    )


def contiguous_plan(cu_seqlens: torch.Tensor) -> AttentionPlan:
    """The plan of a plain packed row: sequence ``i`` is ``cu_seqlens[i]:cu_seqlens[i + 1]``."""
    bounds = cu_seqlens.tolist()
    sequences = [torch.arange(start, end) for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    return plan_sequences(sequences, [torch.ones(len(s), dtype=torch.bool) for s in sequences], bounds[-1])


def _sequences(
    tensor: torch.Tensor, index: torch.Tensor, shapes: list[tuple[int, int]]
) -> list[torch.Tensor]:
    """``tensor [1, H, T, D]`` gathered at ``index`` as one ``[n, H, L, D]`` tensor per ``(n, L)`` in ``shapes``.

    One ``index_select`` over tokens and a split: their backward is one ``index_add`` and one
    concatenation, however many buckets there are (advanced indexing's backward, an
    accumulating ``index_put``, was 10x slower on CPU).
    """
    gathered = tensor.squeeze(0).transpose(0, 1).index_select(0, index)  # [M, H, D]
    pieces = gathered.split([n * length for n, length in shapes])
    return [piece.unflatten(0, shape).transpose(1, 2) for piece, shape in zip(pieces, shapes, strict=True)]


def packed_attention(
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
    """Causal attention within each sequence of the plan (or of ``cu_seq_lens_q``): by
    flash-attention's varlen kernel where it applies (CUDA, fp16/bf16, installed:
    :func:`~tandem.kernels.cuda.varlen.varlen_kernel_for`), else bucket by bucket.

    Shapes: ``query [1, H, T, D]``, ``key, value [1, H_kv, T, D]`` (grouped-query heads are
    shared), ``cu_seq_lens_q [n + 1]`` -> output ``[1, T, H, D]``.
    """
    plan = tandem_attention_plan
    if plan is None:
        if cu_seq_lens_q is None:
            raise ValueError(
                f"{VARLEN_ATTENTION} attention needs cu_seq_lens_q (the packed sequence boundaries) or {PLAN_KEYWORD}"
            )
        plan = contiguous_plan(cu_seq_lens_q.cpu()).to(query.device)
    if query.shape[0] != 1:
        raise ValueError(f"{VARLEN_ATTENTION} attention expects one packed row, got batch {query.shape[0]}")
    dropout_p = dropout if module.training else 0.0
    if query.is_cuda and torch.is_autocast_enabled("cuda"):
        # Under autocast HF's rotary step hands over fp32 queries and keys beside bf16 values;
        # attention runs in the autocast dtype either way (SDPA would cast them itself).
        dtype = torch.get_autocast_dtype("cuda")
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    same_dtype = query.dtype == key.dtype == value.dtype
    kernel = varlen_kernel_for(query, dropout_p, scaling) if same_dtype else None
    ROUTES[kernel.provider if kernel is not None else "bucketed"] += 1
    if kernel is not None:
        return varlen_kernel_attention(kernel, query, key, value, plan.varlen, scaling, dropout_p), None
    return bucketed_attention(query, key, value, plan, scaling, dropout_p), None


def varlen_kernel_attention(
    kernel: VarlenKernel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: VarlenLayout,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """The sequences of ``layout`` through a varlen kernel: gather them unpadded, run, put the
    outputs back in packed order. Shapes as :func:`packed_attention`'s -> ``[1, T, H, D]``."""
    q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # [T, heads, D]
    total = layout.query_index.shape[0]
    if layout.contiguous:  # fillers past the sequences are read by no query
        q, k, v = q[:total], k[:total], v[:total]
    else:
        q = q.index_select(0, layout.query_index)
        k, v = k.index_select(0, layout.key_index), v.index_select(0, layout.key_index)
    out = kernel.run(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        layout.cu_queries,
        layout.cu_keys,
        layout.max_queries,
        layout.max_keys,
        scale,
        dropout_p,
    )  # [Q, H, D]
    if not layout.contiguous or total != layout.select.shape[0]:  # fillers take row 0
        out = out.index_select(0, layout.select)
    return out.unsqueeze(0)


def bucketed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: AttentionPlan,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """The plan's length buckets, one :func:`causal_attention` call each (SDPA on GPUs, the
    CPU kernel's batched products on the CPU). Shapes as :func:`packed_attention`'s."""
    query_shapes = [(n, q_len) for n, q_len, _ in plan.buckets]
    key_shapes = [(n, k_len) for n, _, k_len in plan.buckets]
    pieces = [
        causal_attention(q, k, v, scale, dropout_p, offsets)
        .transpose(1, 2)
        .flatten(0, 1)  # [n, H, L_q, D] -> [n * L_q, H, D]
        for q, k, v, offsets in zip(
            _sequences(query, plan.query_index, query_shapes),
            _sequences(key, plan.index, key_shapes),
            _sequences(value, plan.index, key_shapes),
            plan.offsets,
            strict=True,
        )
    ]
    # Put the owned rows back in packed order with one gather (its backward is one scatter).
    return torch.cat(pieces).index_select(0, plan.select).unsqueeze(0)


AttentionInterface.register(VARLEN_ATTENTION, packed_attention)
