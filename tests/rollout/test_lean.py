"""The lean forward against HF's forward inside the same engine: equal bit for bit; prepacked weights against plain ones."""

import pytest
import torch

from tandem.models import TinyModelConfig, load_model, load_tokenizer, save_tiny_model
from tandem.models.cpu_linear import onednn_available
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, RolloutRequest, SamplingParams
from tandem.rollout.lean import LeanDecoder, lean_unsupported_reason
from tests.rollout.test_native_engine import random_prompts


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_dir(request, tmp_path_factory):
    config = TinyModelConfig(family=request.param, seed=5)
    return str(save_tiny_model(tmp_path_factory.mktemp(f"lean-{request.param}") / "m", config))


def run(model_dir, lean: bool, requests, prepack: bool = False):
    engine = NativeRolloutEngine.from_pretrained(
        model_dir,
        NativeEngineConfig(
            max_num_seqs=16,
            max_model_len=128,
            max_prefill_tokens=200,
            lean_forward=lean,
            prepack_weights=prepack,
        ),
    )
    try:
        assert (engine._lean is not None) == lean
        assert (len(engine._packed) > 0) == (prepack and onednn_available())
        return engine.generate_batch(requests, timeout=120)
    finally:
        engine.close()


def mixed_requests() -> list[RolloutRequest]:
    """Mixed prefill + decode steps, admission over several steps, sampled and greedy, shared prompts."""
    prompts = random_prompts(24, 9)
    return [
        RolloutRequest(
            f"r{i}",
            prompts[i % 20],  # four prompts repeat: the prefix-sharing paths run too
            SamplingParams(
                temperature=0.0 if i % 4 == 0 else 0.9, top_p=0.95, max_tokens=10 + i % 13, seed=i
            ),
        )
        for i in range(24)
    ]


def test_lean_engine_equals_the_hf_forward_engine(model_dir):
    requests = mixed_requests()
    lean, reference = run(model_dir, True, requests), run(model_dir, False, requests)
    for ours, theirs in zip(lean, reference, strict=True):
        assert ours.token_ids == theirs.token_ids
        assert ours.log_probs == theirs.log_probs  # exact: the same operations in the same order


def test_prepacked_weights_match_plain_weights(model_dir):
    """oneDNN's blocked weights change only the summation order: same tokens, log-probs within 1e-5."""
    requests = mixed_requests()
    packed, plain = run(model_dir, True, requests, prepack=True), run(model_dir, True, requests)
    for ours, theirs in zip(packed, plain, strict=True):
        assert ours.token_ids == theirs.token_ids
        assert max(abs(a - b) for a, b in zip(ours.log_probs, theirs.log_probs, strict=True)) < 1e-5


def test_models_outside_the_lean_forward_keep_hf(tmp_path):
    path = save_tiny_model(tmp_path / "m", TinyModelConfig(family="qwen2"))
    model = load_model(path)
    assert lean_unsupported_reason(model) is None
    model.config.use_sliding_window = True
    assert "sliding" in lean_unsupported_reason(model)
    with pytest.raises(ValueError, match="sliding"):
        LeanDecoder(model)
    engine = NativeRolloutEngine(model, load_tokenizer(path))
    try:
        assert engine._lean is None
        out = engine.generate_batch(
            [RolloutRequest("x", (5, 6, 7), SamplingParams(max_tokens=4))], timeout=60
        )[0]
        assert len(out.token_ids) <= 4 and torch.isfinite(torch.tensor(out.log_probs)).all()
    finally:
        engine.close()


def test_bf16_engine_keeps_an_fp32_head(tmp_path):
    """Nothing is prepacked for bf16 weights; the head still runs in fp32 on the bf16 hidden state."""
    path = save_tiny_model(tmp_path / "m", TinyModelConfig(family="qwen2", seed=2))
    prompt = random_prompts(1, 3)[0]
    engine = NativeRolloutEngine.from_pretrained(str(path), NativeEngineConfig(dtype="bfloat16"))
    try:
        assert len(engine._packed) == 0
        out = engine.generate_batch(
            [RolloutRequest("b", prompt, SamplingParams(temperature=0.0, max_tokens=1))], timeout=60
        )[0]
    finally:
        engine.close()
    model = load_model(path, "bfloat16")
    with torch.no_grad():
        hidden = model.get_decoder()(torch.tensor([prompt])).last_hidden_state[0, -1]
        reference = torch.log_softmax(hidden.float() @ model.lm_head.weight.float().t(), -1)
    assert out.token_ids[0] == int(reference.argmax())
    assert abs(out.log_probs[0] - float(reference.max())) < 1e-2  # bf16 layers; the head itself is fp32
