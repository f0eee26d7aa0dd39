"""Per-token log-probabilities and entropy from hidden states, with the output head in fp32, in chunks.

The trainer and the rollout engine both compute ``log softmax(h W^T / T)`` this way so their
numbers agree. Chunking bounds the ``[chunk, V]`` logits held at once: ``chunk_size`` rows at
most, and no more than fit one chunk's fp32 logits in :data:`LOGITS_CHUNK_BYTES` (64 MiB:
320 rows at a 49,152-token vocabulary, 64 at 151,936), so a large vocabulary never
materialises ``[N, V]`` logits for the whole batch. On request the same chunks also give
``sum_v p(v)^2`` (the optimal token baseline's statistic), without a second head pass.

Under autograd the whole head is one function (:class:`ChunkedSoftmaxHead`, the chunked
cross-entropy trick): forward keeps only the hidden states, the labels and two numbers per
row (``log Z`` and ``E_p[z]``); backward recomputes each chunk's logits, turns them in place
into the logits' gradient (closed form: ``d log p_y / dz = onehot(y) - p``, ``dH / dz = -p (z -
E_p[z])``), adds that chunk's share of the head weight's gradient into one ``[V, H]``
buffer and frees the chunk before the next. The softmax's elementwise work runs on blocks of
rows inside the chunk (:data:`SOFTMAX_BLOCK_BYTES`), so forward and backward each hold one
``[chunk, V]`` fp32 buffer plus ~4 MiB of temporaries, and no per-chunk ``[V, H]`` gradient
(measured in ``tests/models/test_fused_head.py``: 1.8 chunks above its inputs in backward
against 5.4 for per-chunk checkpointing, which held recomputed logits, softmax and their
gradients at once). A vocabulary-parallel softmax (``outputs_of_logits``) keeps per-chunk
activation checkpointing (recomputed in backward by autograd).

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

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from tandem.kernels.cpu.linear import linear
from tandem.kernels.cuda.head import half_matmul_fp32

HEAD_DTYPES = ("float32", "bfloat16")
LOGITS_CHUNK_BYTES = 64 * 2**20  # one chunk's fp32 logits at most (module docstring)
SOFTMAX_BLOCK_BYTES = 4 * 2**20  # the fused head's softmax temporaries: rows of this many bytes at once


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
    if temperature == 1.0:
        return logits
    return logits / temperature if torch.is_grad_enabled() else logits.div_(temperature)  # same numbers


def softmax_statistics(
    logits: torch.Tensor, labels: torch.Tensor, with_sum_pi_squared: bool
) -> tuple[torch.Tensor, ...]:
    """``(log_probs [N], entropy [N][, sum_pi_squared [N]], log_z [N], mean_logit [N])`` of
    ``p = softmax(logits [N, V])`` at ``labels [N]``: :func:`softmax_outputs`'s outputs, then
    ``log Z = logsumexp(logits)`` and ``E_p[logits]``, which :class:`ChunkedSoftmaxHead`'s
    backward needs."""
    log_z = torch.logsumexp(logits, dim=-1)
    log_probs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_z
    probs = torch.softmax(logits, dim=-1)
    mean_logit = (probs * logits).sum(-1)
    entropy = log_z - mean_logit
    if not with_sum_pi_squared:
        return log_probs, entropy, log_z, mean_logit
    with torch.no_grad():
        sum_pi_squared = torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * log_z)
    return log_probs, entropy, sum_pi_squared, log_z, mean_logit


def softmax_outputs(
    logits: torch.Tensor, labels: torch.Tensor, with_sum_pi_squared: bool
) -> tuple[torch.Tensor, ...]:
    """``(log_probs [N], entropy [N][, sum_pi_squared [N]])`` of ``softmax(logits [N, V])`` at
    ``labels [N]``; ``sum_pi_squared`` detached (a statistic of the distribution, never differentiated)."""
    return softmax_statistics(logits, labels, with_sum_pi_squared)[:-2]


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


class HeadSettings(NamedTuple):
    """The head's settings that are not tensors: the temperature dividing the logits, rows per
    chunk (one product) and per block (the softmax's elementwise work inside a chunk, so that its
    temporaries stay small: :data:`SOFTMAX_BLOCK_BYTES`), and which extra outputs to return
    (``sum_pi_squared``; the ``top_k`` most likely tokens)."""

    temperature: float
    rows: int
    block_rows: int
    with_sum_pi_squared: bool
    top_k: int


class ChunkedSoftmaxHead(torch.autograd.Function):
    """The fp32 softmax head over all rows, chunk by chunk, saving no logits (module docstring).

    Inputs: ``hidden [N, H]``, ``weight [V, H]`` (fp32, or the parameter the bf16 copy was made
    from), ``weight_bf16 [V, H]`` or None (the ``bfloat16`` head's product), ``labels [N]``,
    ``gather_ids [N, k']`` or None, :class:`HeadSettings`. Outputs in :func:`_chunk_log_probs`'s
    order: ``log_probs [N]``, ``entropy [N]``, then (as asked) ``sum_pi_squared [N]``,
    ``top_log_probs, top_ids [N, k]`` (these three not differentiable) and ``gathered_log_probs
    [N, k']``. Forward gives the per-chunk head's numbers (the same operations, on blocks of
    rows); backward the autograd gradient up to fp32 summation order.
    """

    @staticmethod
    def forward(ctx, hidden, weight, weight_bf16, labels, gather_ids, settings: HeadSettings):
        blocks = []  # per block of rows: the outputs, then log Z and E_p[z]
        for rows in _row_slices(hidden.shape[0], settings.rows):
            logits = head_logits(hidden[rows], weight, settings.temperature, weight_bf16)
            for block in _row_slices(logits.shape[0], settings.block_rows):
                at = _shifted(rows, block)
                gathers = None if gather_ids is None else gather_ids[at]
                *outputs, log_z, mean_logit = softmax_statistics(
                    logits[block], labels[at], settings.with_sum_pi_squared
                )
                blocks.append(
                    (*outputs, *token_choices(logits[block], settings.top_k, gathers), log_z, mean_logit)
                )
            del logits
        *parts, log_z, mean_logit = [torch.cat(part) for part in zip(*blocks, strict=True)]
        operand = weight if weight_bf16 is None else weight_bf16
        ctx.save_for_backward(hidden, operand, labels, gather_ids, log_z, mean_logit)
        ctx.settings, ctx.weight_dtype, ctx.bf16 = settings, weight.dtype, weight_bf16 is not None
        detached = parts[2 : 2 + int(settings.with_sum_pi_squared) + 2 * int(settings.top_k > 0)]
        ctx.mark_non_differentiable(*detached)
        return tuple(parts)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        hidden, operand, labels, gather_ids, log_z, mean_logit = ctx.saved_tensors
        settings = ctx.settings
        grad_gathered = grads[-1] if gather_ids is not None else None
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = operand.new_zeros(operand.shape, dtype=ctx.weight_dtype) if want_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            for rows in _row_slices(hidden.shape[0], settings.rows):
                logits = head_logits(
                    hidden[rows], operand, settings.temperature, operand if ctx.bf16 else None
                )
                for block in _row_slices(logits.shape[0], settings.block_rows):  # in place, block by block
                    at = _shifted(rows, block)
                    _softmax_logits_grad(
                        logits[block], labels[at], log_z[at], mean_logit[at], grads[0][at], grads[1][at],
                        None if gather_ids is None else gather_ids[at],
                        None if grad_gathered is None else grad_gathered[at],
                    )  # fmt: skip
                if settings.temperature != 1.0:
                    logits.div_(settings.temperature)
                _product_backward(logits, hidden[rows], operand, ctx.bf16, grad_hidden, rows, grad_weight)
                del logits  # now the logits' gradient
        return grad_hidden, grad_weight, None, None, None, None


def _softmax_logits_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    log_z: torch.Tensor,
    mean_logit: torch.Tensor,
    grad_log_probs: torch.Tensor,
    grad_entropy: torch.Tensor,
    gather_ids: torch.Tensor | None,
    grad_gathered: torch.Tensor | None,
) -> torch.Tensor:
    """The gradient of ``logits [n, V]`` (overwritten in place and returned), given the upstream
    gradients of ``log_probs``, ``entropy`` ``[n]`` and ``gathered_log_probs [n, k']``:
    ``onehot(y) g_lp + scatter(ids, g_k) - p (g_lp + sum_k g_k + g_H (z - E_p[z]))``, with
    ``p = exp(z - log Z)``."""
    probs = (logits - log_z.unsqueeze(-1)).exp_()  # [n, V], n a block of rows
    coefficient = grad_log_probs if grad_gathered is None else grad_log_probs + grad_gathered.sum(-1)
    grad = logits.sub_(mean_logit.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1))
    grad.add_(coefficient.unsqueeze(-1)).mul_(probs).neg_()
    del probs
    grad.scatter_add_(-1, labels.unsqueeze(-1), grad_log_probs.unsqueeze(-1))
    if grad_gathered is not None:
        grad.scatter_add_(-1, gather_ids, grad_gathered)
    return grad


def _product_backward(
    grad_logits: torch.Tensor,
    hidden: torch.Tensor,
    operand: torch.Tensor,
    bf16: bool,
    grad_hidden: torch.Tensor | None,
    rows: slice,
    grad_weight: torch.Tensor | None,
) -> None:
    """From one chunk's ``grad_logits [n, V]`` fp32: write ``hidden [n, H]``'s gradient into
    ``grad_hidden[rows]`` and add the head weight's share into ``grad_weight [V, H]`` (either
    may be None: not wanted). ``operand`` is the head's fp32 weight or (``bf16``) its bf16 copy;
    the ``bfloat16`` head rounds ``grad_logits`` to bf16 first, as :class:`Bf16HeadProduct`."""
    if bf16:
        grad_logits = grad_logits.to(torch.bfloat16)
        if grad_hidden is not None:
            grad_hidden[rows] = half_matmul_fp32(grad_logits, operand)
        if grad_weight is not None:
            grad_weight += half_matmul_fp32(grad_logits.t(), hidden).to(grad_weight.dtype)
        return
    if grad_hidden is not None:
        grad_hidden[rows] = linear(grad_logits, operand.t())  # [n, V] @ [V, H]
    if grad_weight is not None:
        grad_weight.addmm_(grad_logits.t(), hidden.float())  # in place: no [V, H] per chunk


def chunk_rows(chunk_size: int, vocab: int) -> int:
    """Rows per chunk of the head: ``chunk_size``, lowered so that one chunk's fp32 logits
    ``[rows, vocab]`` fit in :data:`LOGITS_CHUNK_BYTES` (a multiple of 64 rows where 64 fit, so
    the products' shapes repeat from step to step; at least one row)."""
    fitting = LOGITS_CHUNK_BYTES // (4 * max(vocab, 1))
    if fitting >= 64:
        fitting -= fitting % 64
    return max(1, min(chunk_size, fitting))


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
        chunk_size: rows per chunk at most (fewer where a chunk's logits would pass
            :data:`LOGITS_CHUNK_BYTES`: :func:`chunk_rows`).
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
    vocab = head_weight.shape[0]
    block = max(1, SOFTMAX_BLOCK_BYTES // (4 * max(vocab, 1)))
    settings = HeadSettings(temperature, chunk_rows(chunk_size, vocab), block, with_sum_pi_squared, top_k)
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or head_weight.requires_grad)
    if hidden.shape[0] == 0:
        parts = _empty_chunk(hidden, with_sum_pi_squared, top_k, gather_ids)
    elif needs_grad and outputs_of_logits is softmax_outputs:
        parts = ChunkedSoftmaxHead.apply(hidden, head_weight, weight_bf16, labels, gather_ids, settings)
    else:
        parts = _chunked_outputs(
            hidden, head_weight, weight_bf16, labels, gather_ids, settings, outputs_of_logits, needs_grad
        )
    return _named_outputs(parts, with_sum_pi_squared, top_k, gather_ids is not None)


def _row_slices(rows: int, chunk: int) -> list[slice]:
    return [slice(start, min(start + chunk, rows)) for start in range(0, rows, chunk)]


def _shifted(rows: slice, block: slice) -> slice:
    """Rows ``block`` of the chunk ``rows``, as rows of the whole batch."""
    return slice(rows.start + block.start, rows.start + block.stop)


def _chunked_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    weight_bf16: torch.Tensor | None,
    labels: torch.Tensor,
    gather_ids: torch.Tensor | None,
    settings: HeadSettings,
    outputs_of_logits: OutputsOfLogits,
    checkpointed: bool,
) -> list[torch.Tensor]:
    """The head's outputs over all rows (in :func:`_chunk_log_probs`'s order), chunk by chunk;
    ``checkpointed``: each chunk under activation checkpointing (recomputed in backward)."""
    chunks = []
    for rows in _row_slices(hidden.shape[0], settings.rows):
        args = (
            hidden[rows], weight, labels[rows], settings.temperature, settings.with_sum_pi_squared,
            weight_bf16, outputs_of_logits, settings.top_k, None if gather_ids is None else gather_ids[rows],
        )  # fmt: skip
        chunks.append(
            checkpoint(_chunk_log_probs, *args, use_reentrant=False)
            if checkpointed
            else _chunk_log_probs(*args)
        )
    return [torch.cat(part) for part in zip(*chunks, strict=True)]


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


def _named_outputs(
    parts: Sequence[torch.Tensor], with_sum_pi_squared: bool, top_k: int, gathers: bool
) -> HeadOutputs:
    """The head's outputs over all rows (in :func:`_chunk_log_probs`'s order), named."""
    parts = iter(parts)
    log_probs, entropy = next(parts), next(parts)
    sum_pi_squared = next(parts) if with_sum_pi_squared else None
    top_log_probs, top_ids = (next(parts), next(parts)) if top_k else (None, None)
    gathered = next(parts) if gathers else None
    return HeadOutputs(log_probs, entropy, sum_pi_squared, top_log_probs, top_ids, gathered)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reference: ``log_softmax(logits.float())`` gathered at ``labels``. Shapes: ``[..., V], [...] -> [...]``."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
