"""What a rollout engine records of a mixture-of-experts model's routing: each token's experts
per MoE layer, as it was routed when the engine fed it in (:mod:`tandem.models.moe`).

A request's record is its chunks in token order: the prompt's rows (from its prefill, a copy
of another request's, or the prefix cache) then one row per decode step. The last sampled
token is never fed in, so :func:`completed_routing` closes the record with a ``-1`` row.
"""

from __future__ import annotations

import torch

from tandem.models.moe import NOT_ROUTED
from tandem.protocol.sequences import ROUTING_DTYPE


def completed_routing(chunks: list[torch.Tensor], num_tokens: int, layers: int, top_k: int) -> torch.Tensor:
    """``[num_tokens, L, k]`` int16 on the CPU: the chunks ``[n_i, L, k]`` one after another,
    cut or filled with ``NOT_ROUTED`` rows to ``num_tokens`` (prompt plus response)."""
    rows = torch.cat([chunk.cpu() for chunk in chunks]) if chunks else torch.empty(0, layers, top_k)
    out = torch.full((num_tokens, layers, top_k), NOT_ROUTED, dtype=ROUTING_DTYPE)
    kept = min(num_tokens, rows.shape[0])
    out[:kept] = rows[:kept].to(ROUTING_DTYPE)
    return out
