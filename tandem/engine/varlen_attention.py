"""Variable-length causal attention for packed rows, registered with transformers' attention interface.

transformers' SDPA path handles a packed row by building a dense block-causal ``[T, T]``
mask, so its cost grows with the square of the *packed* length. This implementation reads
the sequence boundaries (``cu_seq_lens_q``, the flash-attention varlen argument) and runs
causal SDPA on each sequence alone: the cost is ``sum(len_i^2)``, as with flash-attention's
varlen kernel on GPU. Results equal the padded computation (tests check 1e-5).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

VARLEN_ATTENTION = "tandem_varlen"


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
    pieces = [
        F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            is_causal=True,
            scale=scaling,
            dropout_p=dropout_p,
            enable_gqa=key.shape[1] != query.shape[1],
        )
        for start, end in itertools.pairwise(cu_seq_lens_q.tolist())
        if end > start
    ]
    return torch.cat(pieces, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa_attention)
