"""bf16 on the CPU (``mixed_precision=bf16``): a GRPO-shaped update against the fp32 one, the
fp32 head on the bf16 decoder's hidden states, and the error on a CPU without bf16 instructions.

Tolerances. bf16 keeps 8 significant bits: its machine epsilon is ``2**-7`` (7.8e-3), the
relative step between neighbouring bf16 numbers. Under autocast every linear layer's inputs
are rounded to bf16 once and their products summed in fp32, and the head is fp32, so a
log-prob or a loss must sit within one bf16 step of its own magnitude of the fp32 value
(``rel=2**-7``); rounding the result itself to bf16 would cost that much. On the tiny model the
measured gaps are ~10x smaller (per-token 7.6e-4 relative, loss 1.1e-4, gradient norm 2.1e-4).
After one AdamW step each weight moved by at most ``lr`` (Adam's first step is ``lr * m / sqrt(v)``,
``|m / sqrt(v)| <= 1``), so the two runs' weights differ by at most ``2 * lr`` whatever the
gradients' rounding.
"""

import copy
from pathlib import Path

import pytest
import torch

from tandem.device import check_bf16_compute, cpu_bf16_instructions
from tandem.engine import EngineConfig, TorchTrainEngine, token_model
from tandem.models import TinyModelConfig, build_tiny_model
from tandem.protocol import Batch
from tandem.report.machine import cpu_model_and_flags
from tests.engine.bf16_cpu import needs_bf16_cpu

BF16_EPS = 2.0**-7  # bf16's machine epsilon
LR = 1e-3
PROMPTS, RESPONSES, PROMPT_TOKENS, RESPONSE_TOKENS = 4, 4, 16, 12


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(TinyModelConfig(family="qwen2"), 103, 0, 1, 4)


def grpo_batch(seed: int) -> Batch:
    """``PROMPTS`` prompts x ``RESPONSES`` responses of random lengths, with advantages."""
    gen = torch.Generator().manual_seed(seed)
    rows = PROMPTS * RESPONSES
    prompts = torch.randint(6, 103, (PROMPTS, PROMPT_TOKENS), generator=gen).repeat_interleave(RESPONSES, 0)
    lengths = torch.randint(1, RESPONSE_TOKENS + 1, (rows,), generator=gen)
    response_mask = (torch.arange(RESPONSE_TOKENS) < lengths[:, None]).long()
    responses = torch.randint(6, 103, (rows, RESPONSE_TOKENS), generator=gen) * response_mask
    return Batch(
        {
            "prompts": prompts,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([torch.ones_like(prompts), response_mask], 1),
            "response_mask": response_mask,
            "advantages": torch.randn(rows, 1, generator=gen).expand(-1, RESPONSE_TOKENS).contiguous(),
        }
    )


def policy_gradient_loss(micro: Batch, outputs):
    """``-mean(advantage * log p)`` over response tokens (the shape of a GRPO loss)."""
    mask = micro["response_mask"].float()
    log_probs = outputs.log_probs[:, PROMPT_TOKENS:]
    return -(micro["advantages"] * log_probs * mask).sum() / mask.sum(), {}


def _engine(model, **overrides) -> TorchTrainEngine:
    engine = TorchTrainEngine(EngineConfig(device="cpu", lr=LR, **overrides), model=copy.deepcopy(model))
    engine.initialize()
    return engine


def _response_mask(batch) -> torch.Tensor:
    """``[B, S]`` bool: the response tokens (the ones a GRPO update scores)."""
    mask = batch["attention_mask"].bool().clone()
    mask[:, :PROMPT_TOKENS] = False
    return mask


def test_the_bf16_probe_agrees_with_the_cpu_flags():
    _, flags = cpu_model_and_flags()  # /proc/cpuinfo's flags: the reference on Linux
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo to compare with")
    expected = "amx_bf16" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else None
    assert cpu_bf16_instructions() == expected


@needs_bf16_cpu
def test_a_bf16_grpo_update_agrees_with_fp32_and_keeps_fp32_master_weights(tiny_model):
    batch = grpo_batch(0)
    mask = _response_mask(batch)
    runs = {}
    for precision in ("none", "bf16"):
        engine = _engine(tiny_model, mixed_precision=precision)
        log_probs = engine.forward_backward(batch, None, forward_only=True).outputs.log_probs[mask]
        loss = engine.forward_backward(batch, policy_gradient_loss).loss
        grad_norm = engine.optimizer_step()
        state = [value for group in engine.optimizer.state.values() for value in group.values()]
        runs[precision] = log_probs, loss, grad_norm, dict(engine.iter_parameters()), state
    fp32, bf16 = runs["none"], runs["bf16"]
    assert not torch.equal(bf16[0], fp32[0])  # the decoder really computed in bf16
    torch.testing.assert_close(bf16[0], fp32[0], rtol=BF16_EPS, atol=0)
    assert bf16[1] == pytest.approx(fp32[1], rel=BF16_EPS)
    assert bf16[2] == pytest.approx(fp32[2], rel=BF16_EPS)
    for name, weight in bf16[3].items():
        assert weight.dtype == torch.float32, name  # fp32 master weights
        torch.testing.assert_close(weight, fp32[3][name], rtol=0, atol=2 * LR)
    moments = [value for value in bf16[4] if value.is_floating_point()]  # AdamW's state
    assert moments and all(value.dtype == torch.float32 for value in moments)


@needs_bf16_cpu
def test_the_head_computes_fp32_log_probs_from_the_bf16_decoders_hidden_states(tiny_model, monkeypatch):
    heads = []  # (hidden [N, H], weight [V, H], labels [N], the head's log-probs [N]) of each call
    real_head = token_model.log_probs_from_hidden

    def recording_head(hidden, weight, labels, *settings, **options):
        outputs = real_head(hidden, weight, labels, *settings, **options)
        heads.append((hidden.detach(), weight.detach(), labels, outputs.log_probs.detach()))
        return outputs

    monkeypatch.setattr(token_model, "log_probs_from_hidden", recording_head)  # a spy: the real head runs
    batch = grpo_batch(1)
    fp32_engine, bf16_engine = _engine(tiny_model), _engine(tiny_model, mixed_precision="bf16")
    fp32_engine.forward_backward(batch, None, forward_only=True)
    engine_log_probs = bf16_engine.forward_backward(batch, None, forward_only=True).outputs.log_probs
    (fp32_hidden, *_), (hidden, weight, labels, head_log_probs) = heads
    assert not torch.equal(hidden, fp32_hidden)  # the hidden states carry the bf16 decoder's rounding
    assert weight.dtype == torch.float32 and head_log_probs.dtype == torch.float32
    # an fp32 head outside autocast, on the same hidden states: the same numbers, bit for bit
    chunk = bf16_engine.config.logprob_chunk_size
    expected = real_head(hidden.float(), weight.float(), labels, 1.0, chunk).log_probs
    assert torch.equal(head_log_probs, expected)
    assert torch.equal(engine_log_probs[_response_mask(batch)].sort().values, expected.sort().values)
    # a bf16 head on them would differ: the comparison above can tell the two apart
    rounded = real_head(hidden.bfloat16().float(), weight.bfloat16().float(), labels, 1.0, chunk).log_probs
    assert not torch.equal(rounded, expected)


def _without_bf16_instructions(monkeypatch) -> None:
    """Stand in for an older CPU (none here lacks them): torch's feature probes answer no."""
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: False)


def test_bf16_on_a_cpu_without_bf16_instructions_is_an_error_naming_the_key(monkeypatch, tiny_model):
    _without_bf16_instructions(monkeypatch)
    assert cpu_bf16_instructions() is None
    refused = "engine.mixed_precision=bf16 computes in bf16 on the CPU, but this CPU has no bf16"
    with pytest.raises(ValueError, match=refused):
        EngineConfig(device="cpu", mixed_precision="bf16")
    config = EngineConfig(device="auto", mixed_precision="bf16")  # resolved when the engine binds it
    if torch.cuda.is_available():
        return
    with pytest.raises(ValueError, match=refused):
        TorchTrainEngine(config, model=copy.deepcopy(tiny_model)).initialize()
    check_bf16_compute("engine.mixed_precision", "cuda")  # a GPU is never refused
    assert EngineConfig(device="cpu", mixed_precision="none").mixed_precision == "none"
