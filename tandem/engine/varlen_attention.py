"""Variable-length causal attention for packed rows, registered with transformers' attention interface.

transformers' SDPA path handles a packed row by building a dense block-causal ``[T, T]``
mask, so its cost grows with the square of the *packed* length. This implementation reads
the sequence boundaries (``cu_seq_lens_q``, the flash-attention varlen argument) and runs
causal SDPA within each sequence (sequences of equal length batched into one call): the cost
is ``sum(len_i^2)``, as with flash-attention's varlen kernel on GPU. Results equal the padded
computation (tests check 1e-5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

VARLEN_ATTENTION = "tandem_varlen"


def _gather(tensor: torch.Tensor, index: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Rows ``index`` (``n * L`` packed positions) of ``tensor [1, H, T, D]`` as ``[n, H, L, D]``."""
    return tensor[0, :, index].unflatten(1, shape).transpose(0, 1)


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence.

    Shapes: ``query [1, H, T, D]``, ``key, value [1, H_kv, T, D]`` (grouped-query heads are
    shared), ``cu_seq_lens_q [n + 1]`` -> output ``[1, T, H, D]``.
    """
    if cu_seq_lens_q is None:
        raise ValueError(f"{VARLEN_ATTENTION} attention needs cu_seq_lens_q (the packed sequence boundaries)")
    if query.shape[0] != 1:
        raise ValueError(f"{VARLEN_ATTENTION} attention expects one packed row, got batch {query.shape[0]}")
    dropout_p = dropout if module.training else 0.0
    gqa = key.shape[1] != query.shape[1]
    starts = cu_seq_lens_q[:-1].long()
    lengths = cu_seq_lens_q[1:].long() - starts
    positions, pieces = [], []
    # One batched SDPA call per distinct length: RL batches hold hundreds of short sequences
    # with few distinct lengths, where a call per sequence would dominate the step.
    for length in torch.unique(lengths).tolist():
        if length == 0:
            continue
        chosen = starts[lengths == length]
        if len(chosen) == 1:  # a length of its own: attend on views, no gather
            index = torch.arange(int(chosen), int(chosen) + length, device=chosen.device)
            window = slice(int(chosen), int(chosen) + length)
            q, k, v = query[:, :, window], key[:, :, window], value[:, :, window]
        else:
            index = (chosen.unsqueeze(1) + torch.arange(length, device=chosen.device)).flatten()  # [n * L]
            shape = (len(chosen), length)
            q, k, v = _gather(query, index, shape), _gather(key, index, shape), _gather(value, index, shape)
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, dropout_p=dropout_p, enable_gqa=gqa
        )  # [n, H, L, D]
        positions.append(index)
        pieces.append(attended.transpose(1, 2).flatten(0, 1))  # [n * L, H, D]
    # Put the rows back in packed order with one gather (its backward is one scatter).
    order = torch.argsort(torch.cat(positions))
    output = torch.cat(pieces)[order]
    return output.unsqueeze(0), None


AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa_attention)
