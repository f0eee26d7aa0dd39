"""Vocabulary-parallel log-softmax: log-probs of given tokens and entropy from a vocabulary shard.

With tensor parallelism the output head's ``V`` rows are split over the ``P`` ranks of a
group: rank ``r`` holds rows ``vocab_range(V, P, r)`` (``torch.chunk``'s split, which DTensor's
``Shard(0)`` uses: the first ranks hold ``ceil(V / P)`` rows, the last what remains), and its
logits are ``[N, V_r]``. The full ``[N, V]`` logits are never gathered: per row, the maximum,
the sum of ``exp``, the target token's logit and ``sum_v exp(z_v) z_v`` are reduced over the
group (one ``MAX`` and one ``SUM`` all-reduce per call), and each rank finishes the softmax's
statistics from them. The backward needs no collective: every rank holds the reduced
statistics and computes its own shard's logit gradient.

The hidden states feeding the head are the same on every rank (replicated); each rank's
shard contributes part of their gradient, so :func:`copy_to_tensor_parallel` marks where they
enter the head: identity forward, gradients summed over the group in backward (Megatron-LM's
"copy to tensor-parallel region").
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tandem.models.logprobs import HeadOutputs, log_probs_from_hidden


def vocab_range(vocab: int, size: int, rank: int) -> tuple[int, int]:
    """``(start, end)``: the vocabulary rows rank ``rank`` of ``size`` holds (``torch.chunk``'s split)."""
    chunk = -(-vocab // size)
    start = min(rank * chunk, vocab)
    return start, min(start + chunk, vocab)


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: ProcessGroup):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def copy_to_tensor_parallel(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``tensor`` unchanged (replicated over ``group``); its gradient is summed over the group in
    backward, each rank having computed the part its shard of the next layer contributes."""
    return _CopyToTensorParallel.apply(tensor, group)


class _VocabParallelSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group: ProcessGroup):
        logits = logits.float()
        maximum = logits.max(dim=-1).values  # [N]
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - maximum.unsqueeze(-1)  # [N, V_r], <= 0
        exp = shifted.exp()
        local = labels - vocab_start
        mine = (local >= 0) & (local < logits.shape[-1])
        target = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        sums = torch.stack(
            [
                exp.sum(-1),  # sum_v exp(z_v - m)
                (exp * shifted).sum(-1),  # sum_v exp(z_v - m) (z_v - m)
                torch.where(mine, target, torch.zeros_like(target)),  # z_label - m, on its owner
                (2.0 * shifted).exp().sum(-1),  # sum_v exp(2 (z_v - m))
            ]
        )  # [4, N]
        dist.all_reduce(sums, group=group)
        sum_exp, sum_exp_shifted, target, sum_exp_twice = sums.unbind(0)
        log_z = sum_exp.log()  # log-partition of the shifted logits
        mean_shifted = sum_exp_shifted / sum_exp  # E_p[z - m]
        log_probs = target - log_z
        entropy = log_z - mean_shifted
        sum_pi_squared = sum_exp_twice / sum_exp.square()
        ctx.save_for_backward(shifted, log_z, mean_shifted, local, mine)
        ctx.mark_non_differentiable(sum_pi_squared)
        return log_probs, entropy, sum_pi_squared

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor, grad_entropy: torch.Tensor, _grad_sum_pi_squared):
        shifted, log_z, mean_shifted, local, mine = ctx.saved_tensors
        probs = (shifted - log_z.unsqueeze(-1)).exp()  # [N, V_r], this shard's p_v
        # d log p_label / d z_v = [v == label] - p_v;  d H / d z_v = -p_v (z_v - E_p[z])
        grad = -probs * (
            grad_log_probs.unsqueeze(-1) + grad_entropy.unsqueeze(-1) * (shifted - mean_shifted.unsqueeze(-1))
        )
        rows = mine.nonzero().flatten()
        grad[rows, local[rows]] += grad_log_probs[rows]
        return grad, None, None, None


def vocab_parallel_softmax_outputs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    with_sum_pi_squared: bool,
    vocab_start: int,
    group: ProcessGroup,
) -> tuple[torch.Tensor, ...]:
    """``(log_probs [N], entropy [N][, sum_pi_squared [N]])`` of the softmax over the whole
    vocabulary, from this rank's ``logits [N, V_r]`` (vocabulary ids ``vocab_start ..
    vocab_start + V_r - 1``) and the ``labels [N]`` (whole-vocabulary ids, any rank's).

    Every rank of ``group`` must call it with the same rows; each gets the same outputs.
    ``sum_pi_squared`` is detached. Differentiable in ``logits``.
    """
    log_probs, entropy, sum_pi_squared = _VocabParallelSoftmax.apply(logits, labels, vocab_start, group)
    return (log_probs, entropy, sum_pi_squared) if with_sum_pi_squared else (log_probs, entropy)


def vocab_parallel_log_probs_from_hidden(
    hidden: torch.Tensor,
    head_shard: torch.Tensor,
    labels: torch.Tensor,
    vocab: int,
    group: ProcessGroup,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_sum_pi_squared: bool = False,
    head_dtype: str = "float32",
) -> HeadOutputs:
    """:func:`~tandem.models.logprobs.log_probs_from_hidden` with the head's rows split over ``group``.

    Args:
        hidden: ``[N, H]`` final hidden states, the same on every rank of ``group``.
        head_shard: ``[V_r, H]`` this rank's rows of the output head (``vocab_range``).
        labels: ``[N]`` int64 token ids of the whole vocabulary.
        vocab: ``V``, the whole vocabulary's size.
        group: the tensor-parallel group.
        the rest: as :func:`~tandem.models.logprobs.log_probs_from_hidden`.

    Returns:
        ``HeadOutputs`` ``[N]`` each, the same on every rank. The gradient reaching ``hidden``
        is the whole one (summed over the group); ``head_shard``'s is its rows'.
    """
    start, end = vocab_range(vocab, dist.get_world_size(group), dist.get_rank(group))
    if head_shard.shape[0] != end - start:
        raise ValueError(
            f"a head shard of {head_shard.shape[0]} rows, but this rank holds vocabulary rows {start}..{end - 1}"
        )
    outputs = functools.partial(vocab_parallel_softmax_outputs, vocab_start=start, group=group)
    return log_probs_from_hidden(
        copy_to_tensor_parallel(hidden, group),
        head_shard,
        labels,
        temperature,
        chunk_size,
        with_sum_pi_squared,
        head_dtype,
        outputs_of_logits=outputs,
    )
