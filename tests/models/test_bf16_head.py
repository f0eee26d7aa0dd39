"""The ``bfloat16`` log-prob head against written-out references: its forward is the fp32
head on bf16-rounded inputs; its backward rounds the logits' gradient to bf16 and sums both
products in fp32."""

from __future__ import annotations

import functools

import pytest
import torch

from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.models import TinyModelConfig, build_tiny_model, log_probs_from_hidden
from tandem.sft.loss import sft_loss
from tests.engine.conftest import random_batch


def rounded(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.bfloat16().float()


def head_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(37, 24, generator=gen)
    weight = torch.randn(50, 24, generator=gen) * 0.3
    labels = torch.randint(0, 50, (37,), generator=gen)
    return hidden, weight, labels


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_is_the_fp32_head_on_bf16_rounded_inputs(temperature):
    hidden, weight, labels = head_inputs()
    bf16 = log_probs_from_hidden(hidden, weight, labels, temperature, 8, True, head_dtype="bfloat16")
    reference = log_probs_from_hidden(rounded(hidden), rounded(weight), labels, temperature, 8, True)
    for got, want in zip(bf16[:3], reference[:3], strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    plain = log_probs_from_hidden(hidden, weight, labels, temperature, 8)
    assert (bf16.log_probs - plain.log_probs).abs().max() > 1e-5  # the rounding is real


def test_backward_rounds_the_logit_gradient_and_sums_in_fp32():
    hidden, weight, labels = head_inputs(1)
    upstream = torch.randn(37, generator=torch.Generator().manual_seed(2))
    leaves = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = log_probs_from_hidden(*leaves, labels, 1.0, 8, head_dtype="bfloat16")
    (out.log_probs * upstream + 0.1 * out.entropy).sum().backward()
    # Reference: the gradient of the fp32 rest with respect to the logits, then the two
    # products of its bf16 rounding. The hidden states' gradient arrives in bf16 (they were
    # rounded to bf16 on the way in); the weight's in fp32, summed over the chunks in fp32.
    logits = (rounded(hidden) @ rounded(weight).T).requires_grad_()
    log_z = torch.logsumexp(logits, -1)
    log_probs = logits.gather(-1, labels[:, None]).squeeze(-1) - log_z
    entropy = log_z - (torch.softmax(logits, -1) * logits).sum(-1)
    (log_probs * upstream + 0.1 * entropy).sum().backward()
    grad_logits = rounded(logits.grad)
    torch.testing.assert_close(leaves[0].grad, rounded(grad_logits @ rounded(weight)), atol=1e-6, rtol=0)
    torch.testing.assert_close(leaves[1].grad, grad_logits.T @ rounded(hidden), atol=1e-5, rtol=1e-5)


def test_an_engine_step_with_the_bf16_head_stays_near_the_fp32_head():
    results = {}
    for head_dtype in ("float32", "bfloat16"):
        model = build_tiny_model(TinyModelConfig(family="qwen2"), 103, 0, 1, 4)
        engine = TorchTrainEngine(EngineConfig(logprob_head_dtype=head_dtype), model=model)
        engine.initialize()
        batch = random_batch(0)
        outputs = engine.forward_backward(batch, None, forward_only=True).outputs
        normalizer = engine.global_normalizer(batch["loss_mask"])
        loss = engine.forward_backward(batch, functools.partial(sft_loss, normalizer=normalizer)).loss
        results[head_dtype] = (outputs.log_probs, loss)
    (fp32_lp, fp32_loss), (bf16_lp, bf16_loss) = results["float32"], results["bfloat16"]
    assert 0 < (bf16_lp - fp32_lp).abs().max() < 0.05
    assert bf16_loss == pytest.approx(fp32_loss, rel=1e-2)


def test_bad_head_dtypes_are_named():
    with pytest.raises(ValueError, match="engine.logprob_head_dtype='float16'"):
        EngineConfig(logprob_head_dtype="float16")
    hidden, weight, labels = head_inputs()
    with pytest.raises(ValueError, match="head_dtype='half'"):
        log_probs_from_hidden(hidden, weight, labels, head_dtype="half")
