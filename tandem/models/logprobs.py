"""Per-token log-probabilities and entropy from hidden states, with the output head in fp32, in chunks.

The trainer and the rollout engine both compute ``log softmax(h W^T / T)`` this way so their
numbers agree. Chunking bounds the ``[chunk, V]`` logits held at once; under autograd
each chunk is recomputed in backward (activation checkpointing), so a large vocabulary
never materialises ``[N, V]`` logits for the whole batch. On request the same chunks also
give ``sum_v p(v)^2`` (the optimal token baseline's statistic), without a second head pass.

The head's product runs in one of two precisions (``head_dtype``):

* ``float32`` (the default): ``hidden.float() @ W.float()^T``, all in fp32;
* ``bfloat16``: hidden states and weight rounded to bf16, their products summed in fp32
  (:func:`~tandem.kernels.cuda.head.half_matmul_fp32`: tensor cores on a GPU), logits,
  softmax and everything after them in fp32. When the weights are bf16 already (FSDP2's bf16
  parameters, a bf16 rollout engine) the forward gives the ``float32`` head's numbers up to
  summation order. In backward the logits' gradient is rounded to bf16 before the two
  products (fp32 sums): that part differs from the fp32 head. On a GPU the fp32 head's
  products run on the fp32 units, an order of magnitude slower than tensor cores; at a
  151,936-token vocabulary and hidden 896 they would take ~8x the time of the rest of the
  model's update (see docs/benchmarks.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from tandem.kernels.cpu.linear import linear
from tandem.kernels.cuda.head import half_matmul_fp32

HEAD_DTYPES = ("float32", "bfloat16")


class HeadOutputs(NamedTuple):
    """Per-row outputs of the fp32 head, ``[N]`` float32 each; ``sum_pi_squared`` only when asked."""

    log_probs: torch.Tensor
    entropy: torch.Tensor
    sum_pi_squared: torch.Tensor | None = None


class Bf16HeadProduct(torch.autograd.Function):
    """``logits [N, V] fp32 = hidden [N, H] @ weight [V, H]^T`` from bf16 inputs with fp32 sums.

    ``hidden`` is bf16; ``weight_bf16`` is the weight's bf16 copy, made once per forward
    (not per chunk) and passed beside ``weight`` itself so that the weight's gradient leaves in
    the weight's own dtype: with fp32 parameters (autocast) the chunks' contributions then add
    up in fp32 (in bf16 they would lose precision over ~100 chunks); with bf16 parameters
    (FSDP2's) they add up in bf16 (the fp32 head adds them up in fp32 and rounds once). Backward
    rounds the logits' gradient to bf16 and sums both products in fp32.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, weight_bf16: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight_bf16)
        ctx.weight_dtype = weight.dtype
        return half_matmul_fp32(hidden, weight_bf16.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight_bf16 = ctx.saved_tensors
        grad = grad.to(torch.bfloat16)
        grad_hidden = half_matmul_fp32(grad, weight_bf16) if ctx.needs_input_grad[0] else None  # [N, H]
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = half_matmul_fp32(grad.t(), hidden).to(ctx.weight_dtype)  # [V, H]
        return grad_hidden, grad_weight, None


def _chunk_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    with_sum_pi_squared: bool,
    weight_bf16: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    with torch.autocast(hidden.device.type, enabled=False):  # the head stays fp32 under mixed precision
        if weight_bf16 is not None:  # the bfloat16 head (hidden is bf16 already)
            logits = Bf16HeadProduct.apply(hidden, weight, weight_bf16)  # [N, V] fp32
        else:
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
    head_dtype: str = "float32",
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
        head_dtype: ``float32`` or ``bfloat16``, the precision of the head's product (module
            docstring).

    Returns:
        ``HeadOutputs(log_probs [N], entropy [N], sum_pi_squared [N] or None)`` in float32.
    """
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"hidden has {hidden.shape[0]} rows but labels has {labels.shape[0]}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if head_dtype not in HEAD_DTYPES:
        raise ValueError(f"head_dtype={head_dtype!r} is not one of {list(HEAD_DTYPES)}")
    weight_bf16 = None
    if head_dtype == "bfloat16":  # rounded once, not per chunk
        hidden, weight_bf16 = hidden.to(torch.bfloat16), head_weight.detach().to(torch.bfloat16)
    else:  # cast once, not per chunk: with bf16 weights (FSDP2's) the chunks' gradients add up in fp32
        head_weight = head_weight.float()
    chunks = []
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or head_weight.requires_grad)
    for start in range(0, hidden.shape[0], chunk_size):
        args = (
            hidden[start : start + chunk_size],
            head_weight,
            labels[start : start + chunk_size],
            temperature,
            with_sum_pi_squared,
            weight_bf16,
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
