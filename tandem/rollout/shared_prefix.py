"""Decode attention that reads a prompt shared by several running sequences once ("cascade").

The n samples of a GRPO prompt each hold a copy of the prompt's keys/values in their own
cache slot. Plain decode attention reads all n copies every step; with long prompts that
is most of the cache traffic, and decode attention on the CPU is bound by that traffic.
Here each group's queries attend to one copy of the prefix (one batched product per step
for all groups), each sequence attends to its own tokens after the prefix, and a single
softmax over both parts' scores gives exactly the attention over the whole sequence (the
scores are concatenated, not merged approximately): only the summation order of the final
weighted sum differs from the plain path.

It pays only when many sequences share a prompt that is a large part of what they attend
over; :func:`worth_sharing` is the engine's rule for when, measured with
``bench/cascade_attention.py`` (docs/benchmarks.md, "Shared-prefix cascade attention"): on a
loaded 2-core AVX-512 CPU, with 4 or 8 samples per prompt the cascade took 1.05-1.55x the
plain attention's time at prompts of 52-500 tokens (one exception: 4 x 500 tokens, 256 new,
0.75x), and with 16 it took 0.40-0.75x unless the sequences' own tokens outweigh the prompt
(52 prompt tokens, 256 new: 1.24x).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MIN_MEAN_PREFIX = 48  # shorter prompts: the extra gathers cost about what the skipped reads save
MIN_GROUP_SIZE = 16  # fewer samples per prompt on average: the extra passes cost more than they save
MIN_SAVED_SHARE = 0.5  # at least half of the decode's key/value reads must be prefix copies


def worth_sharing(prefix_lengths: list[int], group_sizes: list[int], own_tokens: float = 0.0) -> bool:
    """Whether reading each group's prefix once saves enough: ``prefix_lengths[g]`` tokens read by
    ``group_sizes[g]`` sequences, each also reading ``own_tokens`` tokens of its own on average
    over the decode (its generated tokens' keys/values, which the cascade does not share)."""
    total = sum(p * n for p, n in zip(prefix_lengths, group_sizes, strict=True))
    tokens = sum(group_sizes)
    if not tokens or total < MIN_MEAN_PREFIX * tokens or tokens < MIN_GROUP_SIZE * len(group_sizes):
        return False
    return total - sum(prefix_lengths) >= MIN_SAVED_SHARE * (total + own_tokens * tokens)


def prefix_groups(keys: list) -> list[list[int]]:
    """Decode tokens ``0..D-1`` grouped by equal ``keys[i]``, groups in first-appearance order."""
    by_key: dict = {}
    for token, key in enumerate(keys):
        by_key.setdefault(key, []).append(token)
    return list(by_key.values())


def group_by_prefix(keys: list, lengths: list[int], own_tokens: float = 0.0) -> SharedPrefixes | None:
    """Decode tokens ``0..D-1`` (token ``i`` in slot ``i``) grouped by equal ``keys[i]`` (a prefix
    of ``lengths[i]`` tokens whose keys/values the token's slot holds), or ``None`` when
    :func:`worth_sharing` says reading each prefix once would not pay (``own_tokens``: the mean
    number of its own tokens a sequence attends over during the rest of the decode)."""
    if sum(lengths) < MIN_MEAN_PREFIX * len(lengths):  # cheap early exit: short prompts
        return None
    groups = prefix_groups(keys)
    prefix_lengths = [lengths[g[0]] for g in groups]
    if not worth_sharing(prefix_lengths, [len(g) for g in groups], own_tokens):
        return None
    return SharedPrefixes.from_groups(groups, [g[0] for g in groups], prefix_lengths)


@dataclass(frozen=True)
class SharedPrefixes:
    """The decode tokens of a step grouped by the prefix their sequences share.

    Attributes:
        members: ``[G, M]`` the decode-token indices of each group, padded to ``M`` by repeating
            the group's first member (padded rows are computed and never read).
        source: ``[G]`` a cache slot holding each group's prefix (any member's slot).
        lengths: ``[G]`` each group's prefix length in tokens.
        group_of, rank_of: ``[D]`` each decode token's group and its row in ``members``.
    """

    members: torch.Tensor
    source: torch.Tensor
    lengths: torch.Tensor
    group_of: torch.Tensor
    rank_of: torch.Tensor

    @classmethod
    def from_groups(cls, groups: list[list[int]], slots: list[int], lengths: list[int]) -> SharedPrefixes:
        """``groups[g]`` lists the decode-token indices sharing a prefix of ``lengths[g]`` tokens
        held in slot ``slots[g]``; every decode token is in exactly one group."""
        width = max(len(g) for g in groups)
        count = sum(len(g) for g in groups)
        group_of, rank_of = [0] * count, [0] * count
        for g, members in enumerate(groups):
            for rank, token in enumerate(members):
                group_of[token], rank_of[token] = g, rank
        padded = [members + [members[0]] * (width - len(members)) for members in groups]
        return cls(
            torch.tensor(padded), torch.tensor(slots), torch.tensor(lengths),
            torch.tensor(group_of), torch.tensor(rank_of),
        )  # fmt: skip

    def to(self, device: torch.device) -> SharedPrefixes:
        """The same grouping with its index tensors on ``device`` (built on the CPU)."""
        return SharedPrefixes(
            *(t.to(device) for t in (self.members, self.source, self.lengths, self.group_of, self.rank_of))
        )

    @functools.cached_property
    def longest(self) -> int:
        return int(self.lengths.max())

    @functools.cached_property
    def shortest(self) -> int:
        return int(self.lengths.min())

    def biases(
        self, positions: torch.Tensor, length: int, kv_heads: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(shared [G * kv_heads, 1, longest], own [D * kv_heads, 1, length - shortest])``: 0 where
        a position is attended, -inf where not. A group sees its prefix ``0..lengths[g]-1``; a
        token sees its own positions from its prefix's end to ``positions[i]``."""
        device = self.lengths.device
        shared = torch.arange(self.longest, device=device) < self.lengths.unsqueeze(-1)  # [G, longest]
        start = self.lengths[self.group_of].unsqueeze(-1)  # [D, 1]
        absolute = torch.arange(self.shortest, length, device=device)
        own = (absolute >= start) & (absolute <= positions.unsqueeze(-1))  # [D, length - shortest]
        return visibility_bias(shared, kv_heads, dtype), visibility_bias(own, kv_heads, dtype)


def visibility_bias(visible: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``visible [N, L]`` bool -> ``[N * kv_heads, 1, L]``: 0 where visible, -inf where not, one
    row per (row, key/value head) as the decode attentions' batched products take it."""
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf")
    )
    return bias.unsqueeze(1).expand(-1, kv_heads, -1).reshape(-1, 1, visible.shape[-1])


def cascade_attention(
    query: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    shared: SharedPrefixes,
    biases: tuple[torch.Tensor, torch.Tensor],
    length: int,
    scale: float,
) -> torch.Tensor:
    """Decode attention with each shared prefix read once.

    Shapes: ``query [D, H, d]`` (token ``i`` in slot ``i``); ``cache_k, cache_v`` one layer's
    cache ``[slots, H_kv, max_len, d]``; ``biases`` from :meth:`SharedPrefixes.biases`;
    ``length`` the attended length (longest position + 1) -> ``[D, H, d]``.
    """
    count, heads, dim = query.shape
    kv_heads = cache_k.shape[1]
    group = heads // kv_heads
    groups, width = shared.members.shape
    top, start = shared.longest, shared.shortest
    shared_bias, own_bias = biases
    # Each group's queries (rows: member, head in the key/value group) against one prefix copy.
    group_rows = query.index_select(0, shared.members.flatten()).view(groups, width, kv_heads, group, dim)
    group_rows = group_rows.transpose(1, 2).reshape(groups * kv_heads, width * group, dim)
    prefix_k = cache_k[:, :, :top].index_select(0, shared.source).view(groups * kv_heads, top, dim)
    prefix_v = cache_v[:, :, :top].index_select(0, shared.source).view(groups * kv_heads, top, dim)
    prefix_scores = torch.baddbmm(shared_bias, group_rows, prefix_k.transpose(1, 2), alpha=scale)
    # ... back to one row block per token: [G, H_kv, M, g, top] -> [D, H_kv, g, top]
    prefix_scores = prefix_scores.view(groups, kv_heads, width, group, top)[
        shared.group_of, :, shared.rank_of
    ]
    # Each token against its own positions after the prefix.
    rows = query.reshape(count * kv_heads, group, dim)
    own_k = cache_k[:count, :, start:length].reshape(count * kv_heads, length - start, dim)
    own_v = cache_v[:count, :, start:length].reshape(count * kv_heads, length - start, dim)
    own_scores = torch.baddbmm(own_bias, rows, own_k.transpose(1, 2), alpha=scale)
    scores = torch.cat([prefix_scores.reshape(count * kv_heads, group, top), own_scores], dim=-1)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if weights.dtype != own_v.dtype:
        weights = weights.to(own_v.dtype)
    prefix_weights, own_weights = weights.split([top, length - start], dim=-1)
    out = torch.bmm(own_weights, own_v).view(count, kv_heads, group, dim)
    # The prefix part: weights back in group layout, one product per group, rows back to tokens.
    grouped = prefix_weights.new_zeros(groups, kv_heads, width, group, top)
    grouped[shared.group_of, :, shared.rank_of] = prefix_weights.view(count, kv_heads, group, top)
    prefix_out = torch.bmm(grouped.view(groups * kv_heads, width * group, top), prefix_v)
    out = out + prefix_out.view(groups, kv_heads, width, group, dim)[shared.group_of, :, shared.rank_of]
    return out.view(count, heads, dim)
