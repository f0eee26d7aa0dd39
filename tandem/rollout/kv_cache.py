"""A slot-based KV cache and the attention function that reads and writes it.

The cache holds, per layer, ``K, V: [slots, kv_heads, max_len, head_dim]``; each running
sequence owns one slot. Running sequences are kept in slots ``0..n-1`` (a finished
sequence's slot is refilled by moving the last one), so batched decode attends over a
plain slice of the cache without gathering.

The attention function is registered with transformers as ``tandem_kv``: HF's own decoder
layers compute projections, rotary embeddings and norms, then call it with the step's
query/key/value; it stores the new keys/values and attends over everything cached. Any
model family whose attention goes through transformers' attention interface (Llama,
Qwen2, Qwen3, Mistral, ...) therefore runs unchanged on the same weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from tandem.device import zeros_on_use
from tandem.rollout.shared_prefix import SharedPrefixes, cascade_attention, visibility_bias

KV_ATTENTION = "tandem_kv"


@dataclass(frozen=True)
class PrefillSegment:
    """Tokens ``[token_start, token_end)`` of the packed row go to ``slot`` at cache positions ``cache_start...``."""

    token_start: int
    token_end: int
    slot: int
    cache_start: int = 0


@dataclass(frozen=True)
class StepPlan:
    """Where each token of one packed forward belongs.

    The packed row is all prefill segments, then one decode token per slot ``0..D-1`` (in
    slot order), decode token ``i`` sitting at cache position ``decode_positions[i]``.
    """

    cache: SlotKVCache
    prefill: tuple[PrefillSegment, ...]
    decode_start: int
    decode_positions: torch.Tensor  # [D] int64
    shared: SharedPrefixes | None = None  # decode tokens grouped by a shared prefix, read once
    attend_length: int | None = None  # the decode's attended length when the caller fixes it

    # Derived once per step (not once per layer): the attended length, the bias, the cache rows.
    @functools.cached_property
    def decode_length(self) -> int:
        """Cache positions the decode tokens attend over: ``attend_length`` when given (a
        CUDA graph's fixed shape), else up to the furthest decode position."""
        if self.attend_length is not None:
            return self.attend_length
        return int(self.decode_positions.max()) + 1

    @functools.cached_property
    def decode_bias(self) -> torch.Tensor:
        """``[D * kv_heads, 1, length]`` float: 0 where decode token ``i`` sees a cached position, -inf
        where it does not, repeated for each of the cache's key/value heads (the rows of
        :func:`decode_attention`'s batched products)."""
        positions = self.decode_positions
        visible = torch.arange(self.decode_length, device=positions.device) <= positions.unsqueeze(-1)
        return visibility_bias(visible, self.cache.shape[1], self.cache.dtype)  # visible: [D, length]

    @functools.cached_property
    def shared_biases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The biases of :func:`~tandem.rollout.shared_prefix.cascade_attention` for this step."""
        return self.shared.biases(
            self.decode_positions, self.decode_length, self.cache.shape[1], self.cache.dtype
        )

    @functools.cached_property
    def decode_rows(self) -> torch.Tensor:
        """``[D * kv_heads]`` int64: where decode token ``i``'s key/value head ``h`` goes in a layer's
        cache viewed as rows of ``head_dim`` (``[slots * kv_heads * max_len, head_dim]``):
        ``(i * kv_heads + h) * max_len + decode_positions[i]``, token-major like the keys."""
        positions, (_, kv_heads, max_len, _) = self.decode_positions, self.cache.shape
        slot_heads = torch.arange(positions.numel() * kv_heads, device=positions.device).view(-1, kv_heads)
        return (slot_heads * max_len + positions.unsqueeze(1)).flatten()


class SlotKVCache:
    """Per-layer key/value storage for ``num_slots`` sequences of up to ``max_len`` tokens."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shape = (num_slots, kv_heads, max_len, head_dim)
        self.num_layers, self.dtype, self.device = num_layers, dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.allocate()

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    @property
    def num_slots(self) -> int:
        return self.shape[0]

    @property
    def max_len(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def allocate(self) -> None:
        """Zeroed storage for every slot; on the CPU only the pages written become resident
        (:func:`tandem.device.zeros_on_use`), so a cache sized for the worst case costs the
        memory of the tokens the engine actually caches."""
        self.keys = [zeros_on_use(self.shape, self.dtype, self.device) for _ in range(self.num_layers)]
        self.values = [zeros_on_use(self.shape, self.dtype, self.device) for _ in range(self.num_layers)]

    def free(self) -> None:
        """Release the memory (sleep); :meth:`allocate` brings it back."""
        self.keys, self.values = [], []

    def move(self, source: int, target: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``source`` into slot ``target``, in every layer."""
        for tensors in (self.keys, self.values):
            for layer in tensors:
                layer[target, :, :length] = layer[source, :, :length]

    def copy_slots(self, sources: list[int], targets: list[int], length: int) -> None:
        """Copy positions ``0..length-1`` of each ``sources[i]`` slot into ``targets[i]``, in every
        layer: one gather and one scatter per cache tensor, however many slots (sources and
        targets disjoint). Positions a target does not use yet may receive the source's later
        positions; they are written before they are ever attended."""
        source, target = torch.tensor(sources, device=self.device), torch.tensor(targets, device=self.device)
        for tensors in (self.keys, self.values):
            for layer in tensors:
                window = layer[:, :, :length]
                window.index_copy_(0, target, window.index_select(0, source))

    def read(self, slot: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of slot ``slot``'s first ``length`` positions: per layer ``[kv_heads, length, head_dim]``."""
        return [k[slot, :, :length].clone() for k in self.keys], [
            v[slot, :, :length].clone() for v in self.values
        ]

    def write(self, slot: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store per-layer ``[kv_heads, n, head_dim]`` tensors at positions ``0..n-1`` of ``slot``."""
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.keys[layer][slot, :, : k.shape[1]] = k
            self.values[layer][slot, :, : v.shape[1]] = v


def cached_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    tandem_plan: StepPlan | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Store this step's keys/values in the cache and attend over each sequence's cached tokens.

    Shapes: ``query [1, H, T, D]``, ``key, value [1, H_kv, T, D]`` -> ``[1, T, H, D]``.
    """
    if tandem_plan is None:
        raise ValueError(
            f"{KV_ATTENTION} attention needs a tandem_plan (it only runs inside the rollout engine)"
        )
    cache, layer = tandem_plan.cache, module.layer_idx
    cache_k, cache_v = cache.keys[layer], cache.values[layer]
    gqa = key.shape[1] != query.shape[1]
    out = torch.empty_like(query)
    for seg in tandem_plan.prefill:
        n = seg.token_end - seg.token_start
        end = seg.cache_start + n
        cache_k[seg.slot, :, seg.cache_start : end] = key[0, :, seg.token_start : seg.token_end]
        cache_v[seg.slot, :, seg.cache_start : end] = value[0, :, seg.token_start : seg.token_end]
        q = query[:, :, seg.token_start : seg.token_end]
        k, v = cache_k[seg.slot : seg.slot + 1, :, :end], cache_v[seg.slot : seg.slot + 1, :, :end]
        if seg.cache_start == 0:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            visible = torch.arange(end, device=q.device) <= (
                seg.cache_start + torch.arange(n, device=q.device)
            ).unsqueeze(-1)
            attended = F.scaled_dot_product_attention(
                q, k, v, attn_mask=visible, scale=scaling, enable_gqa=gqa
            )
        out[:, :, seg.token_start : seg.token_end] = attended
    count = int(tandem_plan.decode_positions.numel())
    if count:
        start = tandem_plan.decode_start
        # [1, H, D_tok, d] -> [D_tok, H, d]
        attended = decode_step_attention(
            tandem_plan,
            layer,
            query[0, :, start : start + count].transpose(0, 1),
            key[0, :, start : start + count].transpose(0, 1),
            value[0, :, start : start + count].transpose(0, 1),
            scaling,
        )
        out[0, :, start : start + count] = attended.transpose(0, 1)
    return out.transpose(1, 2).contiguous(), None


def decode_step_attention(
    plan: StepPlan,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """The decode tokens of a step: store their keys/values in ``layer``'s cache, then attend.

    Shapes: ``query [D, H, d]``, ``key, value [D, H_kv, d]`` (token ``i`` belongs to slot ``i``)
    -> ``[D, H, d]``.
    """
    count, length = query.shape[0], plan.decode_length
    cache_k, cache_v = plan.cache.keys[layer], plan.cache.values[layer]
    for cache, new in ((cache_k, key), (cache_v, value)):
        cache.view(-1, cache.shape[-1]).index_copy_(0, plan.decode_rows, new.reshape(-1, new.shape[-1]))
    if plan.shared is not None:
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        return cascade_attention(query, cache_k, cache_v, plan.shared, plan.shared_biases, length, scale)
    return decode_attention(
        query, cache_k[:count, :, :length], cache_v[:count, :, :length], plan.decode_bias, scale
    )


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """One new token per sequence attending over its cached keys/values.

    Shapes: ``query [D, H, d]``; ``keys, values [D, H_kv, L, d]`` (a slice of the cache: rows of
    ``L`` positions ``max_len`` apart, no copy); ``bias [D * H_kv, 1, L]`` (0 visible, -inf not)
    -> ``[D, H, d]``.

    The query heads sharing a key/value head are stacked as the rows of one product, so each
    cached key/value is read once per step (not once per query head), and the products run
    as batched matrix products over ``D * H_kv`` small matrices — at decode sizes about twice as
    fast on the CPU as the fused attention kernel, which is built for many query rows.
    """
    count, heads, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    rows = query.reshape(count * kv_heads, group, dim)
    scores = torch.baddbmm(
        bias, rows, keys.reshape(count * kv_heads, length, dim).transpose(1, 2), alpha=scale
    )
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if weights.dtype != values.dtype:
        weights = weights.to(values.dtype)
    return torch.bmm(weights, values.reshape(count * kv_heads, length, dim)).view(count, heads, dim)


AttentionInterface.register(KV_ATTENTION, cached_attention)
