"""The native engine's KV cache sized from a memory budget, and its context bounded by the
model's positions: the figure equals the formula, a default shrinks to fit, a set value that
cannot fit is refused naming the keys."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from transformers import AutoConfig

from tandem.device import available_memory_bytes
from tandem.models import TinyModelConfig, save_tiny_model
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, RolloutRequest, SamplingParams
from tandem.rollout.kv_budget import check_positions, plan_kv_cache

MAX_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("kv") / "model", TinyModelConfig(family="qwen2")))


def formula_bytes_per_token(model_dir: str, dtype_bytes: int = 4) -> int:
    """layers x 2 (keys and values) x kv_heads x head_dim x dtype bytes, from the model's config."""
    hf = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return hf.num_hidden_layers * 2 * hf.num_key_value_heads * head_dim * dtype_bytes


def test_an_unset_max_num_seqs_shrinks_to_the_budget_and_generates_as_a_roomy_engine(model_dir):
    per_sequence = formula_bytes_per_token(model_dir) * MAX_LEN
    budget = 2 * per_sequence + per_sequence // 2  # room for two sequences, not three
    small = NativeRolloutEngine.from_pretrained(
        model_dir, NativeEngineConfig(max_model_len=MAX_LEN, kv_cache_memory_bytes=budget)
    )
    roomy = NativeRolloutEngine.from_pretrained(
        model_dir, NativeEngineConfig(max_model_len=MAX_LEN, max_num_seqs=4)
    )
    default = NativeEngineConfig(max_model_len=MAX_LEN)
    try:
        assert small.max_num_seqs == 2 and small.kv_plan.shrunk
        assert small.cache.nbytes == small.kv_plan.nbytes == 2 * per_sequence  # the formula
        assert small.metrics().kv_slots_total == 2
        assert (
            "2 sequences x 64 tokens" in small.kv_plan.describe()
            and "instead of 256" in small.kv_plan.describe()
        )
        assert (
            plan_kv_cache(default, per_sequence // MAX_LEN, 256 * per_sequence).num_slots == 256
        )  # room: the default
        requests = [
            RolloutRequest(str(i), tuple(range(6 + i, 16 + i)), SamplingParams(temperature=0.0, max_tokens=4))
            for i in range(3)
        ]
        # three requests through two slots: the same greedy tokens as all at once
        assert [c.token_ids for c in small.generate_batch(requests)] == [
            c.token_ids for c in roomy.generate_batch(requests)
        ]
    finally:
        small.close()
        roomy.close()


def test_a_set_max_num_seqs_that_cannot_fit_is_refused_naming_the_keys(model_dir):
    per_sequence = formula_bytes_per_token(model_dir) * MAX_LEN
    config = NativeEngineConfig(max_num_seqs=8, max_model_len=MAX_LEN, kv_cache_memory_bytes=5 * per_sequence)
    with pytest.raises(ValueError) as refused:
        NativeRolloutEngine.from_pretrained(model_dir, config)
    message = str(refused.value)
    for key in (
        "rollout.engine.native.max_num_seqs",
        "--max-num-seqs",
        "rollout.engine.native.max_model_len",
    ):
        assert key in message
    assert f"8 sequences x {MAX_LEN} tokens x {formula_bytes_per_token(model_dir)} bytes" in message
    assert "at most 5 fit" in message
    fits = NativeEngineConfig(max_num_seqs=5, max_model_len=MAX_LEN, kv_cache_memory_bytes=5 * per_sequence)
    assert plan_kv_cache(fits, formula_bytes_per_token(model_dir), 5 * per_sequence).num_slots == 5  # kept


def test_not_even_one_sequence_is_refused_naming_max_model_len():
    config = NativeEngineConfig(max_model_len=MAX_LEN, kv_cache_memory_bytes=100)
    with pytest.raises(ValueError, match=r"not even one sequence.*rollout.engine.native.max_model_len"):
        plan_kv_cache(config, 1024, 100)


def test_the_budget_is_a_fraction_of_the_memory_available(model_dir):
    available = available_memory_bytes("cpu")
    meminfo = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemAvailable:")
    )
    assert 0 < available <= meminfo * 1.2  # the kernel's figure, or less under a cgroup limit
    engine = NativeRolloutEngine.from_pretrained(
        model_dir, NativeEngineConfig(max_model_len=MAX_LEN, kv_cache_memory_fraction=0.25)
    )
    try:
        assert 0.15 * available < engine.kv_plan.budget < 0.35 * available
    finally:
        engine.close()


def test_max_model_len_beyond_the_models_positions_is_refused(model_dir):
    with pytest.raises(ValueError) as refused:
        NativeRolloutEngine.from_pretrained(model_dir, NativeEngineConfig(max_model_len=100000))
    message = str(refused.value)
    assert "max_model_len=100000" in message and "max_position_embeddings=2048" in message
    assert "rollout.engine.native.max_model_len" in message and "--max-model-len" in message


def test_rope_scaling_that_may_extend_the_context_warns_instead():
    scaled = AutoConfig.for_model(
        "qwen2",
        max_position_embeddings=128,
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
    )
    with pytest.warns(UserWarning, match="'linear' rope scaling may extend it"):
        check_positions(scaled, 512)
    plain = AutoConfig.for_model("qwen2", max_position_embeddings=128)
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        check_positions(plain, 512)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_positions(plain, 128)  # at the limit: nothing to say
