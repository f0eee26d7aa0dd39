"""What a rollout engine records of a mixture-of-experts model's routing: each token's experts
per MoE layer, as it was routed when the engine fed it in (:mod:`tandem.models.moe`).

A request's record is its chunks in token order: the prompt's rows (from its prefill, a copy
of another request's, or the prefix cache) then one row per decode step. The last sampled
token is never fed in, so :func:`completed_routing` closes the record with a ``-1`` row.

vLLM records per decoder layer instead (:func:`routing_from_decoder_layers`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
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


def routing_from_decoder_layers(
    rows: np.ndarray | None, num_tokens: int, moe_layers: Sequence[int], top_k: int
) -> torch.Tensor:
    """``[num_tokens, L, k]`` int16: a record indexed by decoder layer, as vLLM returns it
    (``CompletionOutput.routed_experts``), in the layout of :func:`completed_routing`.

    ``rows``: ``[n, num_hidden_layers, k]`` (vLLM: uint8, or uint16 past 256 experts), one row per
    token fed in from the prompt's first on; a dense layer's column holds no routing (vLLM leaves
    it 0). ``moe_layers``: the decoder-layer index of each MoE layer, in model order
    (:func:`~tandem.models.moe.moe_layer_indices`), which picks those columns. Rows from the
    response's last token on are dropped (an engine that generated past a stop string tandem
    found fed it in), so that row is ``NOT_ROUTED`` as in every engine; missing rows, or
    ``rows=None``, are ``NOT_ROUTED`` too (routed live by the trainer).
    """
    if rows is None:
        return completed_routing([], num_tokens, len(moe_layers), top_k)
    if rows.ndim != 3 or rows.shape[2] != top_k or rows.shape[1] <= max(moe_layers):
        raise ValueError(
            f"routing rows must be [tokens, decoder layers > {max(moe_layers)}, k={top_k}], "
            f"got {tuple(rows.shape)}"
        )
    fed = rows[: max(num_tokens - 1, 0), list(moe_layers)]
    return completed_routing([torch.from_numpy(fed.astype(np.int64))], num_tokens, len(moe_layers), top_k)
