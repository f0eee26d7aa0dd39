"""Turning logits into the distribution actually sampled from, its log-probabilities, and a sample.

All rows of a decode step are processed together; each row keeps its own temperature,
top-k, top-p and random stream. The log-probability reported for a token is taken from the
same processed distribution the token was drawn from, so on-policy the trainer (computing
the same processing) sees a ratio of exactly 1.
"""

from __future__ import annotations

import functools

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


def _to_signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # unsigned
# the same constants as int64 (tensors wrap like uint64 under + and *)
_GOLDEN_I64, _MIX1_I64, _MIX2_I64 = (_to_signed(c) for c in (_GOLDEN, _MIX1, _MIX2))


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The SplitMix64 step (Steele et al. 2014) on int64 tensors; multiplication wraps mod 2^64 as uint64 does."""
    x = x + _GOLDEN_I64
    x = (x ^ _shift_right(x, 30)) * _MIX1_I64
    x = (x ^ _shift_right(x, 27)) * _MIX2_I64
    return x ^ _shift_right(x, 31)


_MASK64 = (1 << 64) - 1
SMALL_BATCH_KEYS = 32  # up to this many rows, per-row keys are cheaper in Python than as tensor ops


def splitmix64_int(x: int) -> int:
    """SplitMix64 on one Python int (unsigned 64-bit arithmetic); equals :func:`_splitmix64` bit for bit."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=8)
def _mixed_indices(vocab: int, device: torch.device) -> torch.Tensor:
    """``_splitmix64(arange(vocab))``, computed once per vocabulary size (read-only)."""
    return _splitmix64(torch.arange(vocab, dtype=torch.int64, device=device))


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``splitmix64(splitmix64(seed) ^ step)`` per row: ``[B]`` int64 (Python ints for small batches)."""
    if seeds.numel() > SMALL_BATCH_KEYS:
        return _splitmix64(_splitmix64(seeds) ^ steps)
    keys = [
        _to_signed(splitmix64_int(splitmix64_int(seed & _MASK64) ^ (step & _MASK64)))
        for seed, step in zip(seeds.tolist(), steps.tolist(), strict=True)
    ]
    return torch.tensor(keys, dtype=torch.int64, device=seeds.device)


def counter_uniforms(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1) that depend only on (seed, step, token index): a counter-based stream.

    SplitMix64 applied to the seed, then the step, then the token index, so each request's
    draws are reproducible whatever else is in the batch and a whole batch is drawn in one
    vectorised operation. Shapes: ``seeds [B], steps [B]`` int64 -> ``[B, V]`` float32.
    """
    x = _splitmix64(row_keys(seeds, steps).unsqueeze(-1) ^ _mixed_indices(vocab, seeds.device))
    mantissa = _shift_right(x, 11)  # the top 53 bits
    return ((mantissa.double() + 0.5) / float(1 << 53)).float()


def sample_tokens(processed: torch.Tensor, greedy: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from ``softmax(processed)`` (Gumbel-max with the given uniforms), or argmax.

    Shapes: ``processed [B, V]``, ``greedy [B]`` bool, ``uniforms [B, V]`` in (0, 1) -> ``[B]`` int64.
    """
    gumbel = -torch.log(-torch.log(uniforms.clamp(1e-20, 1.0 - 1e-7)))
    sampled = torch.argmax(processed + gumbel, dim=-1)
    return torch.where(greedy, torch.argmax(processed, dim=-1), sampled)
