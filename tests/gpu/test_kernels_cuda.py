"""The GPU tier for ``tandem.kernels.cuda``: flash-attention's varlen kernel (flash-attn or
PyTorch's ``varlen_attn``) against the bucketed SDPA route on the same bf16 inputs, for plain
and shared-prompt plans with fillers, forward and backward; the rollout head's fp32-output
half matmul against the upcast fp32 product. Skipped without CUDA (or without the kernel)."""

from __future__ import annotations

import pytest
import torch

from tandem.engine import EngineConfig, TorchTrainEngine, varlen_attention
from tandem.engine.packing import pack_sequences, pad_to_multiple
from tandem.engine.shared_prompts import pack_shared_prompts
from tandem.engine.varlen_attention import bucketed_attention, varlen_kernel_attention
from tandem.kernels.cuda.head import half_head_logits
from tandem.kernels.cuda.varlen import installed_varlen_kernel, varlen_kernel_for
from tandem.models import TinyModelConfig, build_tiny_model, log_probs_from_hidden
from tests.engine.test_shared_prompts import PROMPT_WIDTH, grouped_batch, outputs_and_grads

pytestmark = pytest.mark.gpu


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("share", [False, True])
def test_the_varlen_kernel_equals_bucketed_sdpa_on_cuda(share):
    """Both bf16 routes against bucketed SDPA on the same inputs in fp32: the kernel's error
    (output and each gradient, as a norm relative to the reference's) is at most twice the
    bf16 SDPA route's, with a floor of bf16's rounding. Elementwise bf16 tolerances fail on a
    few gradient entries where the two backward passes sum in different orders (seen on an
    H200: 10 of 49,152 entries off by up to 0.375, each within a few bf16 steps)."""
    kernel = installed_varlen_kernel()
    if kernel is None:
        pytest.skip("neither flash-attn nor torch.nn.attention.varlen is installed")
    batch = grouped_batch(7, groups=8, n=4)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    packed = pack_shared_prompts(ids, mask, PROMPT_WIDTH) if share else pack_sequences(ids, mask)
    packed = pad_to_multiple(packed, 64).to(torch.device("cuda"))
    plan, tokens = packed.attention_plan, packed.num_tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [
        torch.randn(1, heads, tokens, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
        for heads in (8, 2, 2)
    ]
    assert varlen_kernel_for(inputs[0], 0.0, 0.125) is kernel
    weights = torch.randn(1, tokens, 8, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
    results = []
    for run, dtype in (
        (lambda q, k, v: varlen_kernel_attention(kernel, q, k, v, plan.varlen, 0.125, 0.0), torch.bfloat16),
        (lambda q, k, v: bucketed_attention(q, k, v, plan, 0.125, 0.0), torch.bfloat16),
        (lambda q, k, v: bucketed_attention(q, k, v, plan, 0.125, 0.0), torch.float32),
    ):
        leaves = [t.to(dtype, copy=True).requires_grad_() for t in inputs]
        out = run(*leaves)
        (out.float() * weights.float()).sum().backward()
        results.append([out.float(), *(t.grad.float() for t in leaves)])
    flash, sdpa, reference = results
    for name, got, bf16_sdpa, want in zip(("out", "dq", "dk", "dv"), flash, sdpa, reference, strict=True):
        bound = max(2 * relative_error(bf16_sdpa, want), 2.0**-8)
        assert relative_error(got, want) <= bound, (name, relative_error(got, want), bound)


def test_half_head_logits_equal_the_upcast_fp32_head():
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(64, 896, generator=gen, device="cuda").bfloat16()
    weight = (torch.randn(4096, 896, generator=gen, device="cuda") * 0.05).bfloat16()
    fast = half_head_logits(hidden, weight)
    if fast is None:
        pytest.skip("this PyTorch has no fp32-output half matmul on this GPU")
    reference = hidden.float() @ weight.float().T
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast, reference, atol=1e-4, rtol=1e-5)  # summation order only


def test_the_bf16_log_prob_head_on_cuda_equals_the_cpu_computation():
    """Tensor-core products (fp32 output) on CUDA against the upcast products on the CPU."""
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(300, 128, generator=gen), torch.randn(5000, 128, generator=gen) * 0.1
    labels = torch.randint(0, 5000, (300,), generator=gen)
    upstream = torch.randn(300, generator=gen)
    results = []
    for device in ("cpu", "cuda"):
        leaves = [t.to(device, copy=True).requires_grad_() for t in (hidden, weight)]  # fresh leaves
        out = log_probs_from_hidden(*leaves, labels.to(device), 1.0, 64, head_dtype="bfloat16")
        (out.log_probs * upstream.to(device) + 0.1 * out.entropy).sum().backward()
        results.append([t.detach().cpu() for t in (out.log_probs, out.entropy, *(leaf.grad for leaf in leaves))])
    (cpu_lp, cpu_entropy, cpu_dh, cpu_dw), (gpu_lp, gpu_entropy, gpu_dh, gpu_dw) = results
    torch.testing.assert_close(gpu_lp, cpu_lp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(gpu_entropy, cpu_entropy, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(gpu_dh, cpu_dh, atol=1e-3, rtol=1e-2)  # arrives in bf16
    torch.testing.assert_close(gpu_dw, cpu_dw, atol=1e-4, rtol=1e-4)


def test_an_autocast_engine_takes_the_varlen_route_and_agrees_with_sdpa(monkeypatch):
    """Under autocast HF's rotary step hands fp32 queries/keys beside bf16 values; the packed
    attention casts them to bf16 and takes the kernel. Log-probs agree with the SDPA route."""
    kernel = installed_varlen_kernel()
    if kernel is None:
        pytest.skip("neither flash-attn nor torch.nn.attention.varlen is installed")
    batch = grouped_batch(9)

    def run():
        model = build_tiny_model(TinyModelConfig(family="qwen2"), 103, 0, 1, 4)
        engine = TorchTrainEngine(EngineConfig(device="cuda", mixed_precision="bf16"), model=model)
        engine.initialize()
        return outputs_and_grads(engine, batch)

    varlen_attention.ROUTES.clear()
    flash_out, _ = run()
    assert varlen_attention.ROUTES[kernel.provider] > 0 and varlen_attention.ROUTES["bucketed"] == 0
    monkeypatch.setattr(varlen_attention, "varlen_kernel_for", lambda query, dropout_p, scale: None)
    sdpa_out, _ = run()
    torch.testing.assert_close(flash_out.log_probs, sdpa_out.log_probs, atol=2e-2, rtol=0)
