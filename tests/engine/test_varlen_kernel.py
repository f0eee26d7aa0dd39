"""The flash-attention varlen route against the bucketed route it replaces on CUDA.

The real kernels (flash-attn, PyTorch's ``varlen_attn``) run on CUDA only, so here the
route runs through ``reference_varlen``: flash-attention's contract written out one
sequence at a time (unpadded sequences, bottom-right causal mask, grouped-query heads).
What these tests check is tandem's side: the unpadded layout of plain and shared-prompt
plans, fillers, and the gather back to packed order. ``tests/gpu`` checks the real kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tandem.engine.varlen_attention as varlen_attention
from tandem.engine.packing import pack_sequences, pad_to_multiple
from tandem.engine.shared_prompts import pack_shared_prompts
from tandem.engine.varlen_attention import bucketed_attention, varlen_kernel_attention
from tandem.kernels.cuda.varlen import VarlenKernel, varlen_kernel_for
from tests.engine.test_shared_prompts import PROMPT_WIDTH, engine_for, grouped_batch, outputs_and_grads


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout_p):
    """``q [Q, H, d]``, ``k, v [K, H_kv, d]`` -> ``[Q, H, d]``: sequence ``s`` is rows
    ``cu_q[s]:cu_q[s+1]`` of ``q`` over rows ``cu_k[s]:cu_k[s+1]`` of ``k, v``; its query ``i``
    of ``L_q`` sees keys ``0 .. L_k - L_q + i``."""
    assert dropout_p == 0 and cu_q.dtype == cu_k.dtype == torch.int32
    outputs = []
    for s in range(len(cu_q) - 1):
        rows_q, rows_k = slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1]))
        qs, ks, vs = q[rows_q].transpose(0, 1), k[rows_k].transpose(0, 1), v[rows_k].transpose(0, 1)
        length_q, length_k = qs.shape[1], ks.shape[1]
        assert length_q <= max_q and length_k <= max_k
        visible = torch.arange(length_k) <= (length_k - length_q + torch.arange(length_q)).unsqueeze(-1)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible, scale=scale, enable_gqa=True)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


REFERENCE = VarlenKernel("reference", reference_varlen, dropout=False)


def attention_inputs(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(1, 4, tokens, 8, generator=gen, requires_grad=True)
    key = torch.randn(1, 2, tokens, 8, generator=gen, requires_grad=True)
    value = torch.randn(1, 2, tokens, 8, generator=gen, requires_grad=True)
    return query, key, value


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("fillers", [1, 48])
def test_varlen_layout_equals_bucketed_attention(share, fillers):
    batch = grouped_batch(3)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    packed = pack_shared_prompts(ids, mask, PROMPT_WIDTH) if share else pack_sequences(ids, mask)
    packed = pad_to_multiple(packed, fillers)
    plan = packed.attention_plan
    assert plan.varlen.contiguous == (not share)
    inputs = attention_inputs(packed.num_tokens)
    weights = torch.randn(1, packed.num_tokens, 4, 8)
    results = []
    for run in (
        lambda q, k, v: varlen_kernel_attention(REFERENCE, q, k, v, plan.varlen, 0.3, 0.0),
        lambda q, k, v: bucketed_attention(q, k, v, plan, 0.3, 0.0),
    ):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = run(*leaves)
        (out * weights).sum().backward()
        results.append((out, [t.grad for t in leaves]))
    (varlen_out, varlen_grads), (bucketed_out, bucketed_grads) = results
    assert varlen_out.shape == (1, packed.num_tokens, 4, 8)
    torch.testing.assert_close(varlen_out, bucketed_out, atol=1e-6, rtol=1e-5)
    for got, want in zip(varlen_grads, bucketed_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("share", [False, True])
def test_engine_through_the_varlen_route_equals_the_bucketed_route(monkeypatch, share):
    """A whole forward/backward of a tiny Qwen2 (GQA) with every layer's attention taking the
    varlen route: log-probs, entropy and gradients as with the bucketed route."""
    batch = grouped_batch(6)
    options = dict(share_prompts=share, pad_tokens_to_multiple=32)
    bucketed_out, bucketed_grads = outputs_and_grads(engine_for("qwen2", **options), batch)
    monkeypatch.setattr(varlen_attention, "varlen_kernel_for", lambda query, dropout_p, scale: REFERENCE)
    varlen_out, varlen_grads = outputs_and_grads(engine_for("qwen2", **options), batch)
    torch.testing.assert_close(varlen_out.log_probs, bucketed_out.log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(varlen_out.entropy, bucketed_out.entropy, atol=1e-5, rtol=0)
    for name, grad in bucketed_grads.items():
        torch.testing.assert_close(varlen_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_varlen_kernel_applies_to_half_precision_cuda_tensors_only():
    assert varlen_kernel_for(torch.zeros(1, 2, 3, 8), 0.0, None) is None  # the CPU
    assert varlen_kernel_for(torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16), 0.0, None) is None
