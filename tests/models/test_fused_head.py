"""The fused chunked head (ChunkedSoftmaxHead) against plain autograd over the same operations.

Two references: the per-chunk head under activation checkpointing (what ``log_probs_from_hidden``
ran before, still the path of any other ``outputs_of_logits``) and full ``[N, V]`` logits through
plain autograd. Forward: the same numbers as the per-chunk head, bit for bit. Gradients: within
1e-6 of the reference's norm (fp32 summation order).
"""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.models import TinyModelConfig, build_tiny_model
from tandem.models.logprobs import (
    LOGITS_CHUNK_BYTES,
    SOFTMAX_BLOCK_BYTES,
    chunk_rows,
    log_probs_from_hidden,
    softmax_outputs,
)


def checkpointed_softmax(logits, labels, with_sum_pi_squared):
    """``softmax_outputs`` under another name: ``log_probs_from_hidden`` then takes its
    per-chunk checkpointed path (the reference)."""
    return softmax_outputs(logits, labels, with_sum_pi_squared)


def head_inputs(seed: int, rows: int = 45, vocab: int = 300, width: int = 16):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=gen)
    weight = torch.randn(vocab, width, generator=gen) * 0.5
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    gather_ids = torch.randint(0, vocab, (rows, 3), generator=gen)
    upstream = torch.randn(rows, 5, generator=gen)
    return hidden, weight, labels, gather_ids, upstream


def loss_of(outputs, upstream: torch.Tensor) -> torch.Tensor:
    """A loss that reaches every differentiable output with a different weight per row."""
    loss = (outputs.log_probs * upstream[:, 0]).sum() + (outputs.entropy * upstream[:, 1]).sum()
    if outputs.gathered_log_probs is not None:
        loss = loss + (outputs.gathered_log_probs * upstream[:, 2:]).sum()
    return loss


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def run_head(hidden, weight, labels, outputs_of_logits=softmax_outputs, **settings):
    leaves = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    outputs = log_probs_from_hidden(*leaves, labels, outputs_of_logits=outputs_of_logits, **settings)
    return leaves, outputs


@pytest.mark.parametrize("head_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [4, 16, 4096])  # 45 rows: a last chunk of 1 row at 4
def test_fused_head_equals_the_checkpointed_head(head_dtype, temperature, chunk):
    hidden, weight, labels, gather_ids, upstream = head_inputs(0)
    settings = dict(
        temperature=temperature, chunk_size=chunk, with_sum_pi_squared=True, head_dtype=head_dtype,
        top_k=4, gather_ids=gather_ids,
    )  # fmt: skip
    fused_leaves, fused = run_head(hidden, weight, labels, **settings)
    plain_leaves, plain = run_head(hidden, weight, labels, checkpointed_softmax, **settings)
    for name, got, want in zip(fused._fields, fused, plain, strict=True):
        assert torch.equal(got, want), name  # the same operations: bit for bit
    assert not (fused.sum_pi_squared.requires_grad or fused.top_log_probs.requires_grad)
    loss_of(fused, upstream).backward()
    loss_of(plain, upstream).backward()
    for got, want in zip(fused_leaves, plain_leaves, strict=True):
        assert got.grad.dtype == want.grad.dtype
        # the bf16 head rounds the logits' gradient (and the hidden states') to bf16: an fp32
        # rounding difference flips a few of those roundings (~1e-6 of the norm)
        assert relative_error(got.grad, want.grad) < (1e-6 if head_dtype == "float32" else 1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_head_gradient_equals_full_logits_autograd(temperature):
    hidden, weight, labels, gather_ids, upstream = head_inputs(1)
    leaves, fused = run_head(
        hidden, weight, labels, temperature=temperature, chunk_size=7, gather_ids=gather_ids
    )
    loss_of(fused, upstream).backward()
    reference = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = reference[0] @ reference[1].t() / temperature
    log_softmax = torch.log_softmax(logits, -1)
    log_probs = log_softmax.gather(-1, labels[:, None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    gathered = log_softmax.gather(-1, gather_ids)
    loss = (
        (log_probs * upstream[:, 0]).sum()
        + (entropy * upstream[:, 1]).sum()
        + (gathered * upstream[:, 2:]).sum()
    )
    loss.backward()
    for got, want in zip(leaves, reference, strict=True):
        assert relative_error(got.grad, want.grad) < 1e-6


def test_bf16_hidden_and_weights_get_gradients_in_their_dtypes():
    """The fp32 head on bf16 inputs (FSDP2's bf16 parameters, autocast's hidden states): the
    weight's gradient is summed over the chunks in fp32 and rounded once, as before."""
    hidden, weight, labels, _, upstream = head_inputs(2)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    fused_leaves, fused = run_head(hidden, weight, labels, chunk_size=8)
    plain_leaves, plain = run_head(hidden, weight, labels, checkpointed_softmax, chunk_size=8)
    assert torch.equal(fused.log_probs, plain.log_probs)
    loss_of(fused, upstream).backward()
    loss_of(plain, upstream).backward()
    for got, want in zip(fused_leaves, plain_leaves, strict=True):
        assert got.grad.dtype == torch.bfloat16
        assert relative_error(got.grad, want.grad) < 1e-3  # a few bf16 roundings may flip


@pytest.mark.parametrize("tied", [True, False])
def test_a_tiny_models_gradients_equal_full_logits_autograd(tied):
    """Every parameter's gradient, the tied embedding's included (head + input embedding)."""
    config = TinyModelConfig(family="qwen2", tie_word_embeddings=tied)
    grads = []
    for fused in (True, False):
        model = build_tiny_model(config, 103, 0, 1, 4)
        assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
        input_ids = torch.randint(0, 103, (2, 24), generator=torch.Generator().manual_seed(3))
        labels = input_ids[:, 1:].reshape(-1)
        if fused:
            hidden = model.model(input_ids).last_hidden_state[:, :-1].reshape(-1, config.hidden_size)
            outputs = log_probs_from_hidden(
                hidden, model.get_output_embeddings().weight, labels, chunk_size=5
            )
            log_probs, entropy = outputs.log_probs, outputs.entropy
        else:
            logits = model(input_ids).logits[:, :-1].reshape(-1, 103).float()
            log_softmax = torch.log_softmax(logits, -1)
            log_probs = log_softmax.gather(-1, labels[:, None]).squeeze(-1)
            entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        (log_probs.sum() - 0.3 * entropy.sum()).backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert relative_error(grads[0][name], grads[1][name]) < 1e-5, name  # through the whole body


def test_backward_saves_no_logits():
    """What autograd keeps for the head's backward: the hidden states, the weight, the labels and
    two numbers per row, no ``[rows, V]`` tensor (the checkpointed head saved its chunks' hidden
    states too, then held recomputed logits, softmax and their gradients in backward)."""
    hidden, weight, labels, _, _ = head_inputs(4, rows=64, vocab=500)
    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run_head(hidden, weight, labels, chunk_size=16)
    assert sorted(saved) == sorted([(64, 16), (500, 16), (64,), (64,), (64,)])


def test_chunk_rows_keep_one_chunks_logits_under_the_byte_budget():
    assert chunk_rows(1024, 49_152) == 320  # 320 x 49,152 x 4 B = 60 MiB
    assert chunk_rows(1024, 151_936) == 64
    assert chunk_rows(100, 49_152) == 100  # the key still lowers it
    assert chunk_rows(4096, 300) == 4096
    assert chunk_rows(1024, 10**9) == 1
    for vocab in (1000, 32_000, 49_152, 128_256, 151_936, 262_144):
        assert chunk_rows(10**6, vocab) * vocab * 4 <= LOGITS_CHUNK_BYTES


def test_no_rows_under_autograd():
    hidden, weight, labels, _, _ = head_inputs(5)
    _, outputs = run_head(hidden[:0], weight, labels[:0], top_k=2)
    assert outputs.log_probs.shape == outputs.entropy.shape == (0,)
    assert outputs.top_ids.shape == (0, 2)


def test_blocks_of_rows_inside_a_chunk_change_no_number():
    """A vocabulary wide enough that the softmax's work runs in blocks of rows inside each chunk.
    Sums over 40,000 logits: both fp32 heads are compared with the fp64 gradient, and the fused
    one must be no further from it than the checkpointed one (measured: 1.1e-6 vs 2.3e-6)."""
    vocab, temperature = 40_000, 0.7
    assert SOFTMAX_BLOCK_BYTES // (4 * vocab) < 64  # blocks of 26 rows in chunks of 64
    hidden, weight, labels, gather_ids, upstream = head_inputs(6, rows=70, vocab=vocab, width=8)
    settings = dict(
        temperature=temperature, chunk_size=64, with_sum_pi_squared=True, top_k=3, gather_ids=gather_ids
    )
    fused_leaves, fused = run_head(hidden, weight, labels, **settings)
    plain_leaves, plain = run_head(hidden, weight, labels, checkpointed_softmax, **settings)
    for name, got, want in zip(fused._fields, fused, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
    loss_of(fused, upstream).backward()
    loss_of(plain, upstream).backward()
    exact = hidden.double().requires_grad_(), weight.double().requires_grad_()
    log_softmax = torch.log_softmax(exact[0] @ exact[1].t() / temperature, -1)
    outputs = (
        log_softmax.gather(-1, labels[:, None]).squeeze(-1),
        -(log_softmax.exp() * log_softmax).sum(-1),
        log_softmax.gather(-1, gather_ids),
    )
    loss_of(type(fused)(outputs[0], outputs[1], gathered_log_probs=outputs[2]), upstream.double()).backward()
    for got, checkpointed, want in zip(fused_leaves, plain_leaves, exact, strict=True):
        assert relative_error(got.grad, want.grad) <= max(relative_error(checkpointed.grad, want.grad), 1e-6)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc_in_use():
    """glibc's bytes in use (heap blocks and mmapped ones), or None without glibc's ``mallinfo2``."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


class PeakBytes(TorchDispatchMode):
    """The most bytes ``malloc`` had handed out after any operator inside the block."""

    def __init__(self, in_use) -> None:
        super().__init__()
        self.in_use, self.peak = in_use, in_use()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.in_use())
        return out


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or _malloc_in_use() is None, reason="needs glibc's mallinfo2"
)
def test_backward_holds_about_one_chunk_of_logits():
    """Measured: the memory the head's backward allocates above what it started with. The
    checkpointed head held recomputed logits, softmax and their gradients (5.4 chunks here);
    the fused one a chunk of logits turned into their gradient, the softmax's temporaries of a
    block of rows, the weight's gradient (0.25 chunk) and small change."""
    in_use = _malloc_in_use()
    rows, vocab, width, chunk = 512, 8192, 64, 256
    hidden, weight, labels, _, _ = head_inputs(7, rows=rows, vocab=vocab, width=width)
    chunk_bytes = chunk * vocab * 4
    peaks = {}
    for name in ("fused", "checkpointed", "fused"):  # the first run warms up one-off buffers
        outputs_of_logits = softmax_outputs if name == "fused" else checkpointed_softmax
        _, outputs = run_head(hidden, weight, labels, outputs_of_logits, chunk_size=chunk)
        loss = outputs.log_probs.sum() + outputs.entropy.sum()
        start = in_use()
        with PeakBytes(in_use) as meter:
            loss.backward()
        peaks[name] = (meter.peak - start) / chunk_bytes
    assert peaks["fused"] < 2.2, peaks  # 1 chunk + a 128-row block (0.5) + the weight's gradient (0.25)
    assert peaks["checkpointed"] > 3.5, peaks
