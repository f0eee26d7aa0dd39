"""Per-token log-probabilities and entropy from hidden states, with the output head in fp32, in chunks.

The trainer and the rollout engine both compute ``log softmax(h W^T / T)`` this way so their
numbers agree. Chunking bounds the ``[chunk, V]`` logits held at once; under autograd
each chunk is recomputed in backward (activation checkpointing), so a large vocabulary
never materialises ``[N, V]`` logits for the whole batch. On request the same chunks also
give ``sum_v p(v)^2`` (the optimal token baseline's statistic), without a second head pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from tandem.kernels.cpu.linear import linear


class HeadOutputs(NamedTuple):
    """Per-row outputs of the fp32 head, ``[N]`` float32 each; ``sum_pi_squared`` only when asked."""

    log_probs: torch.Tensor
    entropy: torch.Tensor
    sum_pi_squared: torch.Tensor | None = None


def _chunk_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    with_sum_pi_squared: bool,
) -> tuple[torch.Tensor, ...]:
    with torch.autocast(hidden.device.type, enabled=False):  # the head stays fp32 under mixed precision
        logits = linear(hidden.float(), weight.float())  # [N, V]
    if temperature != 1.0:
        logits = logits / temperature
    log_z = torch.logsumexp(logits, dim=-1)
    log_probs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_z
    probs = torch.softmax(logits, dim=-1)
    entropy = log_z - (probs * logits).sum(-1)
    if not with_sum_pi_squared:
        return log_probs, entropy
    with torch.no_grad():  # a statistic of the distribution, never differentiated
        sum_pi_squared = torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * log_z)
    return log_probs, entropy, sum_pi_squared


def log_probs_from_hidden(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_sum_pi_squared: bool = False,
) -> HeadOutputs:
    """``log p(label)`` and the entropy of ``p = softmax(hidden @ W^T / temperature)``, computed in fp32.

    Args:
        hidden: ``[N, H]`` final hidden states (any dtype).
        head_weight: ``[V, H]`` output-embedding weight.
        labels: ``[N]`` int64 token ids.
        temperature: divides the logits (sampling temperature; 1 for training).
        chunk_size: rows per chunk.
        with_sum_pi_squared: also return ``sum_v p(v)^2 = exp(logsumexp(2z) - 2 logsumexp(z))`` of the
            temperature-scaled logits ``z`` (detached).

    Returns:
        ``HeadOutputs(log_probs [N], entropy [N], sum_pi_squared [N] or None)`` in float32.
    """
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"hidden has {hidden.shape[0]} rows but labels has {labels.shape[0]}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    chunks = []
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or head_weight.requires_grad)
    for start in range(0, hidden.shape[0], chunk_size):
        args = (
            hidden[start : start + chunk_size],
            head_weight,
            labels[start : start + chunk_size],
            temperature,
            with_sum_pi_squared,
        )
        chunks.append(
            checkpoint(_chunk_log_probs, *args, use_reentrant=False)
            if needs_grad
            else _chunk_log_probs(*args)
        )
    if not chunks:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return HeadOutputs(empty, empty, empty if with_sum_pi_squared else None)
    return HeadOutputs(*(torch.cat(parts) for parts in zip(*chunks, strict=True)))


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reference: ``log_softmax(logits.float())`` gathered at ``labels``. Shapes: ``[..., V], [...] -> [...]``."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
