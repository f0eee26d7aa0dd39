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

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from tandem.kernels.cpu.linear import linear
from tandem.kernels.cuda.head import half_matmul_fp32

HEAD_DTYPES = ("float32", "bfloat16")


class HeadOutputs(NamedTuple):
    """Per-row outputs of the fp32 head, ``[N]`` float32 each; ``sum_pi_squared`` only when asked.
    On request also ``[N, k]`` each: the ``k`` most likely tokens (``top_ids``, int64, most likely
    first) and their log-probs (``top_log_probs``, detached), and the log-probs of given tokens
    (``gathered_log_probs``, differentiable)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor
    sum_pi_squared: torch.Tensor | None = None
    top_log_probs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    gathered_log_probs: torch.Tensor | None = None


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


def head_logits(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: float, weight_bf16: torch.Tensor | None
) -> torch.Tensor:
    """``logits [N, V] fp32 = hidden [N, H] @ weight [V, H]^T / temperature`` in the head's precision:
    fp32, or bf16 products summed in fp32 when ``weight_bf16`` (the weight's bf16 copy) is given
    (``hidden`` is then bf16 already). ``weight`` may be a shard of the vocabulary's rows."""
    with torch.autocast(hidden.device.type, enabled=False):  # the head stays fp32 under mixed precision
        if weight_bf16 is not None:
            logits = Bf16HeadProduct.apply(hidden, weight, weight_bf16)
        else:
            logits = linear(hidden.float(), weight.float())
    return logits / temperature if temperature != 1.0 else logits


def softmax_outputs(
    logits: torch.Tensor, labels: torch.Tensor, with_sum_pi_squared: bool
) -> tuple[torch.Tensor, ...]:
    """``(log_probs [N], entropy [N][, sum_pi_squared [N]])`` of ``softmax(logits [N, V])`` at
    ``labels [N]``; ``sum_pi_squared`` detached (a statistic of the distribution, never differentiated)."""
    log_z = torch.logsumexp(logits, dim=-1)
    log_probs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_z
    probs = torch.softmax(logits, dim=-1)
    entropy = log_z - (probs * logits).sum(-1)
    if not with_sum_pi_squared:
        return log_probs, entropy
    with torch.no_grad():
        sum_pi_squared = torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * log_z)
    return log_probs, entropy, sum_pi_squared


OutputsOfLogits = Callable[[torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, ...]]


def token_choices(
    logits: torch.Tensor, top_k: int, gather_ids: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """From ``logits [N, V]``: ``(top_log_probs, top_ids)`` ``[N, k]`` of the ``top_k`` most likely
    tokens (detached; none when ``top_k`` is 0), then the log-probs of ``gather_ids [N, k']``
    (differentiable; none when ``gather_ids`` is None)."""
    if not top_k and gather_ids is None:
        return ()
    log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen: tuple[torch.Tensor, ...] = ()
    if top_k:
        values, ids = log_probs.detach().topk(top_k, dim=-1)
        chosen += (values, ids)
    if gather_ids is not None:
        chosen += (log_probs.gather(-1, gather_ids),)
    return chosen


def _chunk_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    with_sum_pi_squared: bool,
    weight_bf16: torch.Tensor | None,
    outputs_of_logits: OutputsOfLogits,
    top_k: int = 0,
    gather_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    logits = head_logits(hidden, weight, temperature, weight_bf16)
    return outputs_of_logits(logits, labels, with_sum_pi_squared) + token_choices(logits, top_k, gather_ids)


def log_probs_from_hidden(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_sum_pi_squared: bool = False,
    head_dtype: str = "float32",
    outputs_of_logits: OutputsOfLogits = softmax_outputs,
    top_k: int = 0,
    gather_ids: torch.Tensor | None = None,
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
        outputs_of_logits: the softmax's outputs from a chunk's logits (:func:`softmax_outputs`);
            with a shard of the vocabulary's rows as ``head_weight`` (``[V_r, H]``, logits
            ``[N, V_r]``) a vocabulary-parallel one (:mod:`tandem.engine.vocab_parallel`).
        top_k: also return the ``top_k`` most likely tokens and their log-probs (``[N, k]``).
        gather_ids: ``[N, k']`` int64: also return the log-probs of these tokens.

    Returns:
        ``HeadOutputs(log_probs [N], entropy [N], sum_pi_squared [N] or None, top_log_probs,
        top_ids [N, k] or None, gathered_log_probs [N, k'] or None)``, floats in float32.
    """
    _check_head_arguments(hidden, labels, chunk_size, head_dtype)
    hidden, head_weight, weight_bf16 = _head_operands(hidden, head_weight, head_dtype)
    chunks = []
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or head_weight.requires_grad)
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        args = (
            hidden[rows], head_weight, labels[rows], temperature, with_sum_pi_squared, weight_bf16,
            outputs_of_logits, top_k, None if gather_ids is None else gather_ids[rows],
        )  # fmt: skip
        chunks.append(
            checkpoint(_chunk_log_probs, *args, use_reentrant=False)
            if needs_grad
            else _chunk_log_probs(*args)
        )
    if not chunks:
        chunks = [_empty_chunk(hidden, with_sum_pi_squared, top_k, gather_ids)]
    return _joined_outputs(chunks, with_sum_pi_squared, top_k, gather_ids is not None)


def _check_head_arguments(
    hidden: torch.Tensor, labels: torch.Tensor, chunk_size: int, head_dtype: str
) -> None:
    """Refuse ``hidden [N, H]`` and ``labels [N']`` of different rows, a chunk size below 1 and an
    unknown head precision."""
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"hidden has {hidden.shape[0]} rows but labels has {labels.shape[0]}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if head_dtype not in HEAD_DTYPES:
        raise ValueError(f"head_dtype={head_dtype!r} is not one of {list(HEAD_DTYPES)}")


def _head_operands(
    hidden: torch.Tensor, head_weight: torch.Tensor, head_dtype: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(hidden [N, H], head_weight [V, H], weight_bf16 [V, H] or None)`` cast once for every chunk:
    for the ``bfloat16`` head, hidden states and a detached weight copy rounded to bf16; for the
    ``float32`` head, the weight in fp32 (with bf16 weights, FSDP2's, the chunks' gradients then add
    up in fp32)."""
    if head_dtype == "bfloat16":
        return hidden.to(torch.bfloat16), head_weight, head_weight.detach().to(torch.bfloat16)
    return hidden, head_weight.float(), None


def _empty_chunk(
    hidden: torch.Tensor, with_sum_pi_squared: bool, top_k: int, gather_ids: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """The outputs of one chunk of no rows, in :func:`_chunk_log_probs`'s order: ``[0]`` float32
    each, then ``[0, k]`` top-k log-probs and int64 ids, then ``[0, k']`` gathered log-probs."""
    empty = hidden.new_zeros(0, dtype=torch.float32)
    return (
        (empty, empty)
        + ((empty,) if with_sum_pi_squared else ())
        + ((hidden.new_zeros(0, top_k), hidden.new_zeros(0, top_k, dtype=torch.long)) if top_k else ())
        + (() if gather_ids is None else (hidden.new_zeros(0, gather_ids.shape[1]),))
    )


def _joined_outputs(
    chunks: list[tuple[torch.Tensor, ...]], with_sum_pi_squared: bool, top_k: int, gathers: bool
) -> HeadOutputs:
    """The chunks' outputs (each in :func:`_chunk_log_probs`'s order) concatenated over rows, named."""
    parts = iter([torch.cat(part) for part in zip(*chunks, strict=True)])
    log_probs, entropy = next(parts), next(parts)
    sum_pi_squared = next(parts) if with_sum_pi_squared else None
    top_log_probs, top_ids = (next(parts), next(parts)) if top_k else (None, None)
    gathered = next(parts) if gathers else None
    return HeadOutputs(log_probs, entropy, sum_pi_squared, top_log_probs, top_ids, gathered)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reference: ``log_softmax(logits.float())`` gathered at ``labels``. Shapes: ``[..., V], [...] -> [...]``."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
