"""Turning logits into the distribution actually sampled from, its log-probabilities, and a sample.

All rows of a decode step are processed together; each row keeps its own temperature,
top-k, top-p and random stream. The log-probability reported for a token is taken from the
same processed distribution the token was drawn from, so on-policy the trainer (computing
the same processing) sees a ratio of exactly 1.

:func:`draw_step` is what the engine calls once per step: every setting it knows on the
host stays on the host (whether any row truncates), and the step's tokens and log-probs come
back in one device-to-host transfer, a CUDA-graph step's only synchronisation (its small
inputs go over without waiting: :func:`tandem.device.host_tensor`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.device import host_tensor
from tandem.protocol.generation import SamplingParams

NEG_INF = float("-inf")


def processed_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p; removed tokens get ``-inf``.

    Shapes: ``logits [B, V]`` fp32, ``temperature [B]`` (0 means greedy: treated as 1 here;
    ``None``: 1 for all, and ``logits`` are not divided: ``x / 1`` is ``x``), ``top_k [B]`` (0:
    off for that row; ``None``: off for all), ``top_p [B]`` (1: off for that row; ``None``: off
    for all) -> ``[B, V]``. A row's result never depends on the other rows' settings, and
    nothing is read back from the device.
    """
    if temperature is not None:
        scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        logits = logits / scale.unsqueeze(-1)
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, logits.shape[-1]))
        remove |= rank >= k.unsqueeze(-1)
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(remove, NEG_INF), dim=-1)
        mass_before = probs.cumsum(-1) - probs
        truncating = (top_p < 1).unsqueeze(-1)  # a row at 1 keeps every token (no rounding at the tail)
        remove |= (mass_before >= top_p.unsqueeze(-1)) & (rank > 0) & truncating  # always keep the top token
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


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``splitmix64(splitmix64(seed) ^ step)`` per row: ``[B]`` int64 (Python ints for small batches)."""
    if seeds.numel() > SMALL_BATCH_KEYS or seeds.device.type != "cpu":  # no read-back from a GPU
        return _splitmix64(_splitmix64(seeds) ^ steps)
    keys = [
        _to_signed(splitmix64_int(splitmix64_int(seed & _MASK64) ^ (step & _MASK64)))
        for seed, step in zip(seeds.tolist(), steps.tolist(), strict=True)
    ]
    return torch.tensor(keys, dtype=torch.int64, device=seeds.device)


def counter_uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row that depends only on (seed, step): a counter-based stream.

    SplitMix64 applied to the seed, then to the step, so each request's draws are
    reproducible whatever else is in the batch, and a whole batch is drawn at once. The top
    53 bits of the key make the float64 ``(k + 0.5) / 2^53``. Shapes: ``seeds, steps [B]``
    int64 -> ``[B]`` float64.
    """
    mantissa = _shift_right(row_keys(seeds, steps), 11)
    return (mantissa.double() + 0.5) / float(1 << 53)


def draw_tokens(
    processed: torch.Tensor, greedy: torch.Tensor | None, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from ``softmax(processed)`` by inverting its CDF at ``uniforms``, or argmax.

    The CDF is accumulated in float64 (exact enough that a token's chance is its fp32
    probability); ``searchsorted(..., right=True)`` never lands on a token of probability 0
    (one removed by top-k/top-p: its CDF step is flat), and the target stays below the total
    so the last kept token is the furthest it can reach. One uniform per row, so the cost is
    a softmax, a cumulative sum and a search over the vocabulary (Gumbel-max would need a
    random number per vocabulary entry: ~8x slower at a 150k vocabulary on CPU).
    Shapes: ``processed [B, V]``, ``greedy [B]`` bool (``None``: no row is greedy, and no
    argmax is taken), ``uniforms [B]`` float64 in (0, 1) -> tokens ``[B]`` int64 and ``[B]``
    bool: the sampled rows whose probabilities are not finite (their token is meaningless;
    :func:`check_finite` names them).
    """
    cdf = torch.softmax(processed, dim=-1).double().cumsum_(dim=-1)  # [B, V]; one fp64 buffer, not two
    total = cdf[:, -1:]
    broken = ~torch.isfinite(total.squeeze(-1))
    target = torch.minimum(uniforms.unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=processed.shape[-1] - 1)
    if greedy is None:
        return sampled, broken
    return torch.where(greedy, torch.argmax(processed, dim=-1), sampled), broken & ~greedy


def check_finite(broken_rows: Sequence[int]) -> None:
    """Raise ``ValueError`` naming the batch rows whose sampling probabilities are not finite."""
    if broken_rows:
        raise ValueError(
            f"sampling probabilities are not finite (NaN or inf) in batch rows {list(broken_rows)}: a "
            "temperature too small for float32 logits, or non-finite logits"
        )


def sample_tokens(processed: torch.Tensor, greedy: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """:func:`draw_tokens`, raising ``ValueError`` naming the rows whose probabilities are not
    finite (NaN or inf: e.g. logits divided by a temperature so small they overflow) instead
    of returning a meaningless token; greedy rows are exempt (argmax needs no CDF)."""
    tokens, broken = draw_tokens(processed, greedy, uniforms)
    check_finite(broken.nonzero().flatten().tolist())
    return tokens


@dataclass(frozen=True)
class StepDraws:
    """One step's draws on the host: a token per row and its log-probability under the row's
    ``logprobs_mode``."""

    tokens: list[int]
    log_probs: list[float]


def draw_step(
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]
) -> StepDraws:
    """Process, sample and score one step: row ``i`` under ``params[i]`` with the counter
    stream ``(seeds[i], steps[i])``. ``logits [B, V]`` fp32 on any device.

    What no row asks for is skipped (known from ``params``): the division when every
    temperature is 1 (or 0: greedy), the sort when no row truncates, the argmax when no row is
    greedy. The tokens, their log-probs and the finiteness check come back in one transfer.
    Raises ``ValueError`` naming the rows whose probabilities are not finite.
    """
    device = logits.device
    temperatures = [p.temperature for p in params]
    scaled = any(t not in (0.0, 1.0) for t in temperatures)
    temperature = host_tensor(temperatures, torch.float32, device) if scaled else None
    greedy = host_tensor([t == 0 for t in temperatures], torch.bool, device) if 0.0 in temperatures else None
    top_k = top_p = None
    if any(p.top_k > 0 for p in params):
        top_k = host_tensor([p.top_k for p in params], torch.long, device)
    if any(p.top_p < 1 for p in params):
        top_p = host_tensor([p.top_p for p in params], torch.float32, device)
    processed = processed_logits(logits, temperature, top_k, top_p)
    uniforms = counter_uniforms(
        host_tensor(seeds, torch.int64, device),
        host_tensor(steps, torch.int64, device),
    )
    tokens, broken = draw_tokens(processed, greedy, uniforms)
    picked = tokens.unsqueeze(-1)
    log_probs = torch.log_softmax(processed, -1).gather(-1, picked).squeeze(-1)
    raw_rows = [p.logprobs_mode == "raw" for p in params]
    if any(raw_rows):
        raw = torch.log_softmax(logits, -1).gather(-1, picked).squeeze(-1)
        log_probs = torch.where(host_tensor(raw_rows, torch.bool, device), raw, log_probs)
    # fp32 log-probs and token ids (< 2^53) are exact in float64: one transfer for all three.
    host_tokens, host_log_probs, host_broken = torch.stack(
        [tokens.double(), log_probs.double(), broken.double()]
    ).tolist()
    check_finite([row for row, flag in enumerate(host_broken) if flag])
    return StepDraws([int(token) for token in host_tokens], host_log_probs)
