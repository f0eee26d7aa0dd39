"""The lean forward against HF's forward inside the same engine: equal bit for bit; prepacked weights against plain ones."""

import pytest
import torch

from tandem.kernels.cpu.linear import PackedLinears, onednn_available
from tandem.models import TinyModelConfig, load_model, load_tokenizer, save_tiny_model
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, RolloutRequest, SamplingParams
from tandem.rollout.lean import LeanDecoder, RotaryTable, _rms_norm, _rotate, lean_unsupported_reason
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
        assert (engine.lean_decoder is not None) == lean
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
        assert engine.lean_decoder is None
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


def test_rotation_equals_hf_apply_rotary_pos_emb():
    """The swapped-halves form with a signed sine is HF's rotate_half form, bit for bit."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    torch.manual_seed(0)
    model = load_model(save_tiny_model_cached("qwen2"))
    positions = torch.randint(0, 500, (37,))
    table = RotaryTable(model.get_decoder().rotary_emb)
    q, k = torch.randn(37, 4, 32), torch.randn(37, 2, 32)  # head_dim 128 / 4
    cos, sin = model.get_decoder().rotary_emb(q, positions.unsqueeze(0))  # [1, T, d]
    expected_q, expected_k = apply_rotary_pos_emb(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin
    )
    cos_rows, signed_sin = table(positions, q)
    assert torch.equal(_rotate(q, cos_rows, signed_sin), expected_q[0].transpose(0, 1))
    assert torch.equal(_rotate(k, cos_rows, signed_sin), expected_k[0].transpose(0, 1))


def test_rotary_table_equals_the_module_at_every_position_and_grows():
    model = load_model(save_tiny_model_cached("llama"))
    rotary = model.get_decoder().rotary_emb
    table = RotaryTable(rotary)
    like = torch.zeros(1, 8)
    for positions in (torch.tensor([0, 5, 255]), torch.arange(300, 700, 7), torch.tensor([1023, 2])):
        cos, signed_sin = table(positions, like)
        ref_cos, ref_sin = rotary(like.unsqueeze(0), positions.unsqueeze(0))
        half = ref_sin.shape[-1] // 2
        assert torch.equal(cos[:, 0], ref_cos[0])
        assert torch.equal(signed_sin[:, 0], torch.cat((-ref_sin[0, :, :half], ref_sin[0, :, half:]), -1))
    assert table._cos.shape[0] >= 1024
    rotary.rope_type = "dynamic"  # frequencies that depend on the length seen: computed every step
    assert not RotaryTable(rotary).cacheable


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_hf_module(dtype):
    model = load_model(
        save_tiny_model_cached("qwen3"), dtype="float32" if dtype == torch.float32 else "bfloat16"
    )
    norm = model.get_decoder().layers[0].input_layernorm
    head_norm = model.get_decoder().layers[0].self_attn.q_norm
    with torch.no_grad():
        norm.weight.copy_(torch.randn_like(norm.weight))
    for scale in (1e-3, 1.0, 40.0):
        x = (torch.randn(23, norm.weight.shape[0]) * scale).to(dtype)
        assert torch.equal(_rms_norm(x, norm), norm(x))
        heads = (torch.randn(23, 80) * scale).to(dtype)[:, 8:72].view(23, 2, 32)  # not contiguous
        assert torch.equal(_rms_norm(heads, head_norm), head_norm(heads))


@pytest.mark.skipif(not onednn_available(), reason="needs oneDNN (fused products)")
def test_fused_qk_rotation_equals_rotating_each_product():
    model = load_model(save_tiny_model_cached("qwen2"))
    lean = LeanDecoder(model, PackedLinears(model))
    x, positions = torch.randn(11, model.config.hidden_size), torch.arange(3, 14)
    cos, signed_sin = lean.rotary(positions, x)
    q, k, v = lean._attention_inputs(1, x, cos, signed_sin)
    q_ref, k_ref, v_ref = (t.reshape(11, -1, 32) for t in lean.packed.forward_fused(lean.qkv[1], x))
    assert torch.equal(q, _rotate(q_ref, cos, signed_sin))
    assert torch.equal(k, _rotate(k_ref, cos, signed_sin))
    assert torch.equal(v, v_ref)


_TINY_DIRS: dict[str, str] = {}


def save_tiny_model_cached(family: str) -> str:
    """A tiny model directory per family, written once per test session."""
    if family not in _TINY_DIRS:
        import tempfile

        root = tempfile.mkdtemp(prefix=f"lean-unit-{family}-")
        _TINY_DIRS[family] = str(save_tiny_model(f"{root}/m", TinyModelConfig(family=family, seed=3)))
    return _TINY_DIRS[family]
