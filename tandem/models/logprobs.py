"""Per-token log-probabilities and entropy from hidden states, with the output head in fp32, in chunks.

The trainer and the rollout engine both compute ``log softmax(h W^T / T)`` this way so their
numbers agree. Chunking bounds the ``[chunk, V]`` logits held at once; under autograd
each chunk is recomputed in backward (activation checkpointing), so a large vocabulary
never materialises ``[N, V]`` logits for the whole batch.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from tandem.kernels.cpu.linear import linear


def _chunk_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.autocast(hidden.device.type, enabled=False):  # the head stays fp32 under mixed precision
        logits = linear(hidden.float(), weight.float())  # [N, V]
    if temperature != 1.0:
        logits = logits / temperature
    log_z = torch.logsumexp(logits, dim=-1)
    log_probs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_z
    probs = torch.softmax(logits, dim=-1)
    entropy = log_z - (probs * logits).sum(-1)
    return log_probs, entropy


def log_probs_from_hidden(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p(label)`` and the entropy of ``softmax(hidden @ W^T / temperature)``, computed in fp32.

    Args:
        hidden: ``[N, H]`` final hidden states (any dtype).
        head_weight: ``[V, H]`` output-embedding weight.
        labels: ``[N]`` int64 token ids.
        temperature: divides the logits (sampling temperature; 1 for training).
        chunk_size: rows per chunk.

    Returns:
        ``(log_probs [N], entropy [N])`` in float32.
    """
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"hidden has {hidden.shape[0]} rows but labels has {labels.shape[0]}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    out_lp, out_ent = [], []
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or head_weight.requires_grad)
    for start in range(0, hidden.shape[0], chunk_size):
        args = (
            hidden[start : start + chunk_size],
            head_weight,
            labels[start : start + chunk_size],
            temperature,
        )
        lp, ent = (
            checkpoint(_chunk_log_probs, *args, use_reentrant=False)
            if needs_grad
            else _chunk_log_probs(*args)
        )
        out_lp.append(lp)
        out_ent.append(ent)
    if not out_lp:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(out_lp), torch.cat(out_ent)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reference: ``log_softmax(logits.float())`` gathered at ``labels``. Shapes: ``[..., V], [...] -> [...]``."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
