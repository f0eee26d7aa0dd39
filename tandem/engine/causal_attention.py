"""Causal attention of packed sequences grouped by length, with optional query offsets.

The trainer's varlen attention (:mod:`tandem.engine.varlen_attention`) calls this once per
length bucket. fp32 CPU buckets of short sequences go to the batched-product kernel of the
CPU kernels package (:mod:`tandem.kernels.cpu.attention`); everything else (GPUs, whose
fused kernels are the fast path there; other dtypes; dropout; long sequences) goes to
``scaled_dot_product_attention``.

A sequence may ask for queries at its last positions only (:class:`QueryOffsets`): a
response that shares its group's prompt needs no queries at the prompt's positions (one
row of the group computes those), only keys. Its ``L_q`` queries then sit at key positions
``offset .. offset + L_q - 1`` and each sees the keys up to its own position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.cpu.attention import (
    MAX_LENGTH,
    GroupedCausalAttention,
    additive_bias,
    batched_attention_applies,
    causal_bias,
)

__all__ = ["MAX_LENGTH", "QueryOffsets", "causal_attention"]


class QueryOffsets:
    """Where each sequence's queries start among its keys: ``offsets [n]`` (int64).

    Query ``i`` of sequence ``s`` sits at key position ``offsets[s] + i`` and sees keys
    ``0 .. offsets[s] + i``. The masks built from it are kept, so the layers of one forward
    build them once.
    """

    def __init__(self, offsets: torch.Tensor) -> None:
        self.offsets = offsets
        self._masks: dict[tuple, torch.Tensor] = {}

    def visible(self, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
        """``[n, 1, L_q, L_k]`` bool: True where a query may see a key."""
        key = ("visible", q_len, k_len, device)
        if key not in self._masks:
            offsets = self.offsets.to(device)
            last = offsets[:, None] + torch.arange(q_len, device=device)  # [n, L_q]
            self._masks[key] = (torch.arange(k_len, device=device) <= last[..., None]).unsqueeze(1)
        return self._masks[key]

    def bias(
        self, kv_heads: int, group: int, q_len: int, k_len: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """``[n * kv_heads, group * L_q, L_k]`` additive bias (0 visible, -inf not) laid out as
        :class:`~tandem.kernels.cpu.attention.GroupedCausalAttention`'s score rows."""
        key = ("bias", kv_heads, group, q_len, k_len, dtype, device)
        if key not in self._masks:
            bias = additive_bias(self.visible(q_len, k_len, device), dtype)  # [n, 1, L_q, L_k]
            n = bias.shape[0]
            self._masks[key] = (
                bias.unsqueeze(2)
                .expand(n, kv_heads, group, q_len, k_len)
                .reshape(n * kv_heads, group * q_len, k_len)
            )
        return self._masks[key]


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    dropout_p: float = 0.0,
    offsets: QueryOffsets | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence over its own keys; grouped-query heads shared.

    Shapes: ``q [n, H, L_q, d]``, ``k, v [n, H_kv, L_k, d]`` -> ``[n, H, L_q, d]``. Without
    ``offsets`` query ``i`` sits at key position ``i`` (``L_q == L_k``, plain causal attention).
    fp32 sequences on the CPU of up to :data:`MAX_LENGTH` keys without dropout or autocast take
    the CPU kernel's batched products; the rest (GPUs, whose fused kernels are the fast path there;
    dropout; bf16 autocast) go to ``scaled_dot_product_attention``.
    """
    heads, q_len = q.shape[1], q.shape[2]
    kv_heads, k_len = k.shape[1], k.shape[2]
    if offsets is None and q_len != k_len:
        raise ValueError(f"{q_len} queries over {k_len} keys need QueryOffsets")
    if not batched_attention_applies(q, k, v, dropout_p):
        gqa = kv_heads != heads
        if offsets is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
            )
        mask = offsets.visible(q_len, k_len, q.device)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
        )
    group = heads // kv_heads
    if offsets is None:
        bias = causal_bias(group, k_len, q.dtype, q.device)
    else:
        bias = offsets.bias(kv_heads, group, q_len, k_len, q.dtype, q.device)
    return GroupedCausalAttention.apply(q, k, v, bias, q.shape[-1] ** -0.5 if scale is None else scale)
