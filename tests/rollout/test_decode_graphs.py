"""Decode steps in CUDA-graph form (padded to batch and length buckets, static buffers)
against the engine's plain decode. Here the bucketed step runs eagerly on the CPU
(``use_cuda_graphs=False``); ``tests/gpu`` replays real graphs against the same reference."""

from __future__ import annotations

import pytest
import torch

from tandem.models import TinyModelConfig, save_tiny_model
from tandem.rollout import NativeRolloutEngine, RolloutRequest, SamplingParams
from tandem.rollout.decode_graphs import DecodeGraphs, graph_batch, graph_length
from tests.rollout.test_native_engine import native, random_prompts


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("graphs") / "qwen2", TinyModelConfig(family="qwen2", seed=5)))


def mixed_requests(count: int) -> list[RolloutRequest]:
    """Greedy and sampled requests whose lengths end at different steps and cross the 128- and
    256-position length buckets (prompts of 1..40 tokens, up to 230 new ones)."""
    requests = []
    for i, prompt in enumerate(random_prompts(count, 21)):
        params = SamplingParams(
            temperature=0.0 if i % 2 else 1.0,
            top_k=20 if i % 3 == 0 else 0,
            max_tokens=int(10 + (i * 37) % 220),
            ignore_eos=True,
            seed=1000 + i,
        )
        requests.append(RolloutRequest(f"g{i}", prompt, params))
    return requests


def with_eager_graphs(engine: NativeRolloutEngine) -> NativeRolloutEngine:
    engine.decode_graphs = DecodeGraphs(engine.lean_decoder, engine.cache, use_cuda_graphs=False)
    return engine


def test_bucketed_decode_steps_equal_the_plain_decode(qwen2_dir):
    """Admission over several steps (so slots fill, empty and refill), sequences ending at
    different steps (the batch bucket shrinks), lengths crossing length buckets."""
    requests = mixed_requests(40)
    settings = dict(max_num_seqs=24, max_model_len=300, max_prefill_tokens=200)
    plain = native(qwen2_dir, **settings)
    bucketed = with_eager_graphs(native(qwen2_dir, **settings))
    try:
        assert plain.decode_graphs is None  # the CPU: no graphs unless asked for
        want = plain.generate_batch(requests, timeout=300)
        got = bucketed.generate_batch(requests, timeout=300)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5, rtol=0)
        assert bucketed.stats.graph_steps > 0.8 * bucketed.stats.steps
        assert plain.stats.graph_steps == 0
        lengths = {length for _, length in bucketed.decode_graphs.pairs}
        batches = {batch for batch, _ in bucketed.decode_graphs.pairs}
        assert {128, 256} <= lengths and len(batches) >= 3
    finally:
        plain.close()
        bucketed.close()


def check_sleep_drops_the_graphs_and_wake_repeats_the_tokens(engine: NativeRolloutEngine, count: int) -> None:
    """Generate, sleep (the graphs go), wake, generate the same requests again: same tokens.
    The engine is closed afterwards."""
    try:
        requests = mixed_requests(count)
        before = engine.generate_batch(requests, timeout=300)
        assert len(engine.decode_graphs) > 0
        engine.sleep()
        assert len(engine.decode_graphs) == 0
        engine.wake()
        again = [RolloutRequest(r.request_id + "'", r.prompt_ids, r.params) for r in requests]
        after = engine.generate_batch(again, timeout=300)
        assert [c.token_ids for c in after] == [c.token_ids for c in before]
    finally:
        engine.close()


def test_sleep_drops_the_graphs_and_wake_gives_the_same_outputs(qwen2_dir):
    check_sleep_drops_the_graphs_and_wake_repeats_the_tokens(with_eager_graphs(native(qwen2_dir, max_num_seqs=8)), 6)


def test_buckets():
    assert [graph_batch(n) for n in (1, 2, 3, 5, 64, 65, 256)] == [1, 2, 4, 8, 64, 128, 256]
    assert [graph_length(n) for n in (1, 128, 129, 1000, 2048, 2049, 4000)] == [
        128, 128, 256, 1024, 2048, 2304, 4096,
    ]  # fmt: skip


def test_bucket_caps_and_bad_sizes(qwen2_dir):
    engine = native(qwen2_dir, max_num_seqs=48, max_model_len=300)
    try:
        graphs = DecodeGraphs(engine.lean_decoder, engine.cache, use_cuda_graphs=False)
        assert graphs.bucket(33, 200) == (48, 256)  # 64 slots capped at the cache's 48
        assert graphs.bucket(3, 290) == (4, 300)  # 384 positions capped at max_model_len
        with pytest.raises(ValueError, match="49 decode tokens for a cache of 48 slots"):
            graphs.bucket(49, 10)
        with pytest.raises(ValueError, match="attended length 301 outside 1..300"):
            graphs.bucket(1, 301)
        with pytest.raises(ValueError, match="CUDA graphs need the KV cache on a CUDA device"):
            DecodeGraphs(engine.lean_decoder, engine.cache)
    finally:
        engine.close()


def test_steps_that_admit_from_the_prefix_cache_stay_off_the_graph_path(qwen2_dir):
    """Requests sharing a prompt refill freed slots straight from the prefix cache (no
    prefill); a padded graph step then would write into those slots, so such steps run the
    plain path and every request's tokens and log-probs equal the plain engine's."""
    prompts = random_prompts(3, 8, low=10, high=30)
    requests = [
        RolloutRequest(f"p{i}", prompts[i % 3], SamplingParams(temperature=1.0, max_tokens=5 + (i * 7) % 23, seed=i))
        for i in range(24)
    ]
    plain = native(qwen2_dir, max_num_seqs=5)
    bucketed = with_eager_graphs(native(qwen2_dir, max_num_seqs=5))
    try:
        want = plain.generate_batch(requests, timeout=120)
        got = bucketed.generate_batch(requests, timeout=120)
        assert bucketed.stats.prefix_hits > 0 and bucketed.stats.graph_steps > 0
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5, rtol=0)
    finally:
        plain.close()
        bucketed.close()


def test_a_failed_capture_falls_back_to_eager_steps(qwen2_dir):
    """A capture that raises (here: the CPU has no CUDA graphs) leaves the engine generating:
    that step and every later one run eagerly, with the plain engine's tokens."""
    requests = mixed_requests(10)
    plain = native(qwen2_dir, max_num_seqs=8)
    engine = with_eager_graphs(native(qwen2_dir, max_num_seqs=8))
    engine.decode_graphs.use_cuda_graphs = True  # capture for real: it fails on the CPU
    try:
        want = plain.generate_batch(requests, timeout=120)
        got = engine.generate_batch(requests, timeout=120)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert all(c.finish_reason == "length" for c in got)
        graphs = engine.decode_graphs
        assert graphs.failure and not graphs.use_cuda_graphs and graphs.captures == 0
    finally:
        plain.close()
        engine.close()
