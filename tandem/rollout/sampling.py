"""Turning logits into the distribution actually sampled from, its log-probabilities, and a sample.

All rows of a decode step are processed together; each row keeps its own temperature,
top-k, top-p and random stream. The log-probability reported for a token is taken from the
same processed distribution the token was drawn from, so on-policy the trainer (computing
the same processing) sees a ratio of exactly 1.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def processed_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p; removed tokens get ``-inf``.

    Shapes: ``logits [B, V]`` fp32, ``temperature [B]`` (0 means greedy: treated as 1 here),
    ``top_k [B]`` (0: off), ``top_p [B]`` (1: off) -> ``[B, V]``.
    """
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    logits = logits / scale.unsqueeze(-1)
    use_k, use_p = bool((top_k > 0).any()), bool((top_p < 1).any())
    if not (use_k or use_p):
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, logits.shape[-1]))
        remove |= rank >= k.unsqueeze(-1)
    if use_p:
        probs = torch.softmax(sorted_logits.masked_fill(remove, NEG_INF), dim=-1)
        mass_before = probs.cumsum(-1) - probs
        remove |= (mass_before >= top_p.unsqueeze(-1)) & (rank > 0)  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(remove, NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_tokens(processed: torch.Tensor, greedy: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from ``softmax(processed)`` (Gumbel-max with the given uniforms), or argmax.

    Shapes: ``processed [B, V]``, ``greedy [B]`` bool, ``uniforms [B, V]`` in (0, 1) -> ``[B]`` int64.
    """
    gumbel = -torch.log(-torch.log(uniforms.clamp(1e-20, 1.0 - 1e-7)))
    sampled = torch.argmax(processed + gumbel, dim=-1)
    return torch.where(greedy, torch.argmax(processed, dim=-1), sampled)
