"""The native rollout engine against the hf reference engine and the trainer."""

import math
import time

import pytest
import torch

from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.models import TinyModelConfig, load_model, save_tiny_model
from tandem.protocol import Batch
from tandem.rollout import (
    HFRolloutEngine,
    NativeEngineConfig,
    NativeRolloutEngine,
    RolloutRequest,
    SamplingParams,
)
from tandem.rollout.sampling import processed_logits


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_dir(request, tmp_path_factory):
    return str(
        save_tiny_model(
            tmp_path_factory.mktemp(request.param) / "model", TinyModelConfig(family=request.param)
        )
    )


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return str(
        save_tiny_model(
            tmp_path_factory.mktemp("qwen2-parity") / "model", TinyModelConfig(family="qwen2", seed=3)
        )
    )


def native(path, **overrides):
    settings = {"max_num_seqs": 128, "max_model_len": 256, **overrides}
    return NativeRolloutEngine.from_pretrained(path, NativeEngineConfig(**settings))


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.001)


def random_prompts(count: int, seed: int, low: int = 1, high: int = 40) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=gen).tolist()
    return [tuple(torch.randint(6, 103, (n,), generator=gen).tolist()) for n in lengths]


def greedy(prompt, rid, max_tokens=24, **extra):
    return RolloutRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra))


def test_greedy_single_request_equals_hf(model_dir):
    engine = native(model_dir)
    try:
        request = greedy(random_prompts(1, 0)[0], "one", max_tokens=40, ignore_eos=True)
        ours = engine.generate_batch([request], timeout=60)[0]
        reference = HFRolloutEngine.from_pretrained(model_dir).generate_batch([request])[0]
        assert ours.token_ids == reference.token_ids and len(ours.token_ids) == 40
        assert max(abs(a - b) for a, b in zip(ours.log_probs, reference.log_probs, strict=True)) < 1e-5
    finally:
        engine.close()


def test_greedy_100_concurrent_mixed_lengths_equal_hf(model_dir):
    engine = native(model_dir, max_num_seqs=48, max_prefill_tokens=300)  # forces admission over several steps
    try:
        requests = [
            greedy(p, f"r{i}", max_tokens=int(8 + (i * 7) % 30), ignore_eos=i % 3 != 0)
            for i, p in enumerate(random_prompts(100, 1))
        ]
        ours = engine.generate_batch(requests, timeout=120)
        reference = HFRolloutEngine.from_pretrained(model_dir).generate_batch(requests)
        mismatched = [
            r.request_id
            for r, a, b in zip(requests, ours, reference, strict=True)
            if a.token_ids != b.token_ids
        ]
        assert not mismatched
        assert [c.finish_reason for c in ours] == [c.finish_reason for c in reference]
    finally:
        engine.close()


def trainer_log_probs(
    path: str, prompts, completions, temperature: float, device: str = "auto"
) -> list[torch.Tensor]:
    """Per-response log-probs recomputed by the training engine (packed, fp32 head) on ``device``."""
    trainer = TorchTrainEngine(
        EngineConfig(
            model_path=path, logprob_temperature=temperature, max_tokens_per_micro_batch=8192, device=device
        )
    )
    trainer.initialize()
    rows = [list(p) + c.token_ids for p, c in zip(prompts, completions, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    out = trainer.forward_backward(
        Batch({"input_ids": ids, "attention_mask": mask}), None, forward_only=True
    ).outputs
    return [
        out.log_probs[i, len(p) : len(p) + len(c.token_ids)]
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
    ]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_equal_the_trainers(qwen2_dir, temperature):
    engine = native(qwen2_dir)
    try:
        prompts = random_prompts(32, 2)
        params = SamplingParams(temperature=temperature, max_tokens=48, seed=None)
        completions = engine.generate_batch(
            [RolloutRequest(f"s{i}", p, params) for i, p in enumerate(prompts)], timeout=120
        )
    finally:
        engine.close()
    trainer = trainer_log_probs(qwen2_dir, prompts, completions, temperature)
    deltas = torch.cat([torch.tensor(c.log_probs) - t for c, t in zip(completions, trainer, strict=True)])
    assert deltas.numel() > 500
    assert deltas.abs().max() <= 1e-5, float(deltas.abs().max())
    assert abs(float(torch.exp(deltas.double()).mean()) - 1.0) <= 1e-6


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 5, 1.0), (0.8, 0, 0.9), (1.3, 20, 0.7), (0.5, 3, 0.95)]
)
def test_processed_log_probs_are_the_renormalised_truncated_distribution(
    qwen2_dir, temperature, top_k, top_p
):
    engine = native(qwen2_dir)
    try:
        prompts = random_prompts(8, 3)
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=16, ignore_eos=True
        )
        completions = engine.generate_batch(
            [RolloutRequest(f"p{i}", p, params) for i, p in enumerate(prompts)], timeout=60
        )
    finally:
        engine.close()
    model = load_model(qwen2_dir)
    for prompt, completion in zip(prompts, completions, strict=True):
        expected, kept = processed_reference(model, prompt, completion, temperature, top_k, top_p)
        assert torch.isfinite(expected).all()  # every sampled token survived truncation
        torch.testing.assert_close(torch.tensor(completion.log_probs), expected, atol=1e-5, rtol=0)
        if top_k:
            assert int((kept > float("-inf")).sum(-1).max()) <= top_k


def processed_reference(model, prompt, completion, temperature, top_k, top_p):
    """The reference: HF's forward over prompt + response, processed as the sampler does.

    Returns the log-probability of each response token under the renormalised truncated
    distribution ``[steps]`` and the processed logits ``[steps, V]``.
    """
    with torch.no_grad():
        hidden = model.get_decoder()(torch.tensor([list(prompt) + completion.token_ids])).last_hidden_state[0]
    logits = hidden.float() @ model.lm_head.weight.float().t()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion.token_ids)]
    n = rows.shape[0]
    kept = processed_logits(
        rows, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p)
    )
    picked = torch.tensor(completion.token_ids).unsqueeze(-1)
    return torch.log_softmax(kept, -1).gather(-1, picked).squeeze(-1), kept


def test_processed_truncation_matches_a_loop_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 30, generator=gen)
    settings = [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.0, 0, 0.5), (2.0, 10, 0.8), (0.3, 1, 0.9), (1.0, 30, 0.999)]
    temperature, top_k, top_p = (torch.tensor(column) for column in zip(*settings, strict=True))
    out = processed_logits(logits, temperature.float(), top_k.long(), top_p.float())
    for row, (t, k, p) in enumerate(settings):
        scaled = (logits[row] / t).tolist()
        order = sorted(range(30), key=lambda j: -scaled[j])
        keep = order[: k or 30]
        if p < 1:
            weights = [math.exp(scaled[j]) for j in keep]
            total, mass, kept = sum(weights), 0.0, []
            for j, w in zip(keep, weights, strict=True):
                if mass >= p:  # stop once the tokens before this one already reach p
                    break
                kept.append(j)
                mass += w / total
            keep = kept
        for j in range(30):
            if j in keep:
                assert abs(float(out[row, j]) - scaled[j]) < 1e-5
            else:
                assert out[row, j] == float("-inf")


def test_sampled_tokens_follow_the_processed_distribution(qwen2_dir):
    """Chi-square: first tokens of 3000 seeded requests against the processed next-token probabilities."""
    prompt = random_prompts(1, 4)[0]
    params = [SamplingParams(temperature=0.9, top_k=12, max_tokens=1, seed=s) for s in range(3000)]
    engine = native(qwen2_dir, max_num_seqs=256)
    try:
        completions = engine.generate_batch(
            [RolloutRequest(f"c{i}", prompt, p) for i, p in enumerate(params)], timeout=300
        )
        assert engine.stats.prefilled_tokens == len(prompt)  # the shared prompt ran through the model once
    finally:
        engine.close()
    model = load_model(qwen2_dir)
    with torch.no_grad():
        hidden = model.get_decoder()(torch.tensor([prompt])).last_hidden_state[0, -1]
        logits = (hidden.float() @ model.lm_head.weight.float().t()).unsqueeze(0)
    probs = torch.softmax(
        processed_logits(logits, torch.tensor([0.9]), torch.tensor([12]), torch.tensor([1.0])), -1
    )[0]
    counts = torch.bincount(
        torch.tensor([c.token_ids[0] for c in completions]), minlength=probs.numel()
    ).double()
    support = probs > 0
    assert counts[~support].sum() == 0  # nothing outside the top-k
    expected = probs[support].double() * len(completions)
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)  # far beyond p=0.001 would fail
    # and the reported log-probs are those probabilities
    for c in completions[:50]:
        assert abs(c.log_probs[0] - math.log(float(probs[c.token_ids[0]]))) < 1e-5


def test_seeded_requests_do_not_depend_on_what_else_runs(qwen2_dir):
    engine = native(qwen2_dir)
    try:
        target = RolloutRequest(
            "t", random_prompts(1, 5)[0], SamplingParams(max_tokens=30, seed=123, ignore_eos=True)
        )
        alone = engine.generate_batch([target], timeout=60)[0]
        crowd = [
            RolloutRequest(f"o{i}", p, SamplingParams(max_tokens=40))
            for i, p in enumerate(random_prompts(20, 6))
        ]
        together = engine.generate_batch(
            [*crowd[:10], RolloutRequest("t2", target.prompt_ids, target.params), *crowd[10:]], timeout=60
        )[10]
        assert together.token_ids == alone.token_ids
    finally:
        engine.close()


def test_n_samples_share_one_prefill_and_greedy_copies_agree(qwen2_dir):
    engine = native(qwen2_dir)
    try:
        prompt = random_prompts(1, 7, low=20, high=30)[0]
        outs = engine.generate_batch([greedy(prompt, f"g{i}", ignore_eos=True) for i in range(8)], timeout=60)
        assert engine.stats.prefilled_tokens == len(prompt)
        assert all(o.token_ids == outs[0].token_ids for o in outs)
        reference = HFRolloutEngine.from_pretrained(qwen2_dir).generate_batch(
            [greedy(prompt, "ref", ignore_eos=True)]
        )[0]
        assert outs[0].token_ids == reference.token_ids
    finally:
        engine.close()


def perturbed_weights(path: str, scale: float = 0.05):
    model = load_model(path)
    gen = torch.Generator().manual_seed(9)
    return [
        (name, tensor + scale * torch.randn(tensor.shape, generator=gen))
        for name, tensor in model.state_dict().items()
    ]


def test_in_flight_weight_update_with_keep(qwen2_dir):
    engine = native(qwen2_dir)
    try:
        prompt = random_prompts(1, 8, low=10, high=20)[0]
        first = engine.generate_batch([greedy(prompt, "warm", max_tokens=4)], timeout=60)[
            0
        ]  # caches the prompt at v0
        futures = [
            engine.submit(RolloutRequest(f"f{i}", prompt, SamplingParams(max_tokens=200, ignore_eos=True)))
            for i in range(4)
        ]
        wait_until(lambda: engine.num_running == 4 and engine.stats.generated_tokens >= 4 + 4 * 5)
        engine.pause("keep")
        assert engine.num_running == 4
        new_weights = perturbed_weights(qwen2_dir)
        assert engine.update_weights(new_weights, version=1) == len(new_weights)
        hits = engine.stats.prefix_hits
        engine.resume()
        done = [f.result(timeout=60) for f in futures]
        for completion in done:
            versions = completion.weight_versions
            assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
            assert len(completion.token_ids) == 200
        after = engine.generate_batch([greedy(prompt, "after", max_tokens=4)], timeout=60)[0]
        assert engine.stats.prefix_hits == hits  # the v0 prompt entry was not reused
        hf = HFRolloutEngine.from_pretrained(qwen2_dir)
        hf.update_weights(new_weights, version=1)
        assert after.token_ids == hf.generate_batch([greedy(prompt, "ref", max_tokens=4)])[0].token_ids
        assert after.weight_versions == [1] * 4 and first.weight_versions == [0] * 4
    finally:
        engine.close()


def test_pause_abort_and_wait_modes(qwen2_dir):
    engine = native(qwen2_dir)
    try:
        prompts = random_prompts(6, 9)
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        futures = [engine.submit(RolloutRequest(f"a{i}", p, long)) for i, p in enumerate(prompts[:3])]
        wait_until(lambda: engine.num_running == 3)
        engine.pause("abort")
        aborted = [f.result(timeout=30) for f in futures]
        assert all(c.finish_reason == "abort" and len(c.token_ids) < 200 for c in aborted)
        engine.resume()
        futures = [
            engine.submit(RolloutRequest(f"w{i}", p, SamplingParams(max_tokens=30, ignore_eos=True)))
            for i, p in enumerate(prompts[3:])
        ]
        wait_until(lambda: engine.num_running == 3)
        engine.pause("wait")
        assert engine.num_running == 0
        assert all(f.done() and f.result().finish_reason == "length" for f in futures)
        engine.resume()
        assert engine.abort("nobody") is False
    finally:
        engine.close()


def test_sleep_frees_the_cache_and_wake_restores_identical_outputs(qwen2_dir):
    engine = native(qwen2_dir)
    try:
        requests = [greedy(p, f"z{i}") for i, p in enumerate(random_prompts(6, 10))]
        before = engine.generate_batch(requests, timeout=60)
        allocated = engine.cache.nbytes
        engine.sleep()
        assert engine.cache.nbytes == 0 and allocated > 0
        engine.wake()
        assert engine.cache.nbytes == allocated
        after = engine.generate_batch(
            [greedy(r.prompt_ids, r.request_id + "'") for r in requests], timeout=60
        )
        assert [c.token_ids for c in after] == [c.token_ids for c in before]
    finally:
        engine.close()


def test_weights_loaded_asleep_are_the_ones_generating_after_wake(qwen2_dir):
    """The colocated loop syncs weights into a sleeping engine (its cache comes back later)."""
    engine = native(qwen2_dir)
    try:
        requests = [greedy(p, f"s{i}") for i, p in enumerate(random_prompts(4, 12))]
        engine.generate_batch(requests, timeout=60)
        engine.sleep()
        new_weights = perturbed_weights(qwen2_dir)
        engine.update_weights(new_weights, version=1)
        assert engine.cache.nbytes == 0  # still asleep
        engine.wake()
        after = engine.generate_batch(
            [greedy(r.prompt_ids, r.request_id + "'") for r in requests], timeout=60
        )
        hf = HFRolloutEngine.from_pretrained(qwen2_dir)
        hf.update_weights(new_weights, version=1)
        assert [c.token_ids for c in after] == [c.token_ids for c in hf.generate_batch(requests)]
        assert all(c.weight_versions == [1] * len(c.token_ids) for c in after)
    finally:
        engine.close()


def test_stops_and_abort(qwen2_dir):
    engine = native(qwen2_dir)
    try:
        prompt = random_prompts(1, 11)[0]
        free = engine.generate_batch([greedy(prompt, "free", max_tokens=30, ignore_eos=True)], timeout=60)[0]
        stop_token = free.token_ids[5]
        stopped = engine.generate_batch(
            [greedy(prompt, "stop", max_tokens=30, ignore_eos=True, stop_token_ids=(stop_token,))], timeout=60
        )[0]
        assert (
            stopped.token_ids == free.token_ids[: free.token_ids.index(stop_token) + 1]
            and stopped.finish_reason == "stop"
        )
        text = engine.tokenizer.decode(free.token_ids)
        needle = text[8:11]
        by_string = engine.generate_batch(
            [greedy(prompt, "str", max_tokens=30, ignore_eos=True, stop=(needle,))], timeout=60
        )[0]
        assert needle in engine.tokenizer.decode(by_string.token_ids) and len(by_string.token_ids) < 30
        future = engine.submit(
            RolloutRequest("long", prompt, SamplingParams(max_tokens=10_000, ignore_eos=True))
        )
        wait_until(lambda: engine.num_running > 0)
        assert engine.abort("long")
        assert future.result(timeout=30).finish_reason == "abort"
        limit = engine.generate_batch(
            [RolloutRequest("ctx", prompt, SamplingParams(max_tokens=10_000, ignore_eos=True))], timeout=60
        )[0]
        assert limit.finish_reason == "length" and len(prompt) + len(limit.token_ids) == 256
    finally:
        engine.close()


def test_bad_requests_fail_alone(qwen2_dir):
    engine = native(qwen2_dir)
    try:
        good = engine.submit(greedy((10, 11, 12), "good"))
        bad = {
            "empty": engine.submit(greedy((), "empty")),
            "long": engine.submit(greedy(tuple([7] * 300), "long")),
            "vocab": engine.submit(greedy((5, 99999), "vocab")),
            "dup": engine.submit(greedy((10, 11), "good")),
        }
        messages = {k: str(f.exception(timeout=10)) for k, f in bad.items()}
        assert "prompt is empty" in messages["empty"]
        assert "300 tokens; the context limit is 256" in messages["long"]
        assert "unknown token ids [99999]" in messages["vocab"]
        assert "already in flight" in messages["dup"]
        assert good.result(timeout=30).finish_reason in ("stop", "length")
        with pytest.raises(ValueError, match="sampling.top_p=0"):
            SamplingParams(top_p=0)
        with pytest.raises(ValueError, match="sampling.temperature=-1"):
            SamplingParams(temperature=-1)
        with pytest.raises(RuntimeError, match="needs the engine paused"):
            engine.submit(RolloutRequest("busy", (10,), SamplingParams(max_tokens=10_000, ignore_eos=True)))
            wait_until(lambda: engine.num_running > 0)
            engine.update_weights(perturbed_weights(qwen2_dir), version=5)
    finally:
        engine.close()


def test_counter_uniforms_are_uniform_and_depend_only_on_their_counters():
    from tandem.rollout.sampling import counter_uniforms

    seeds = torch.tensor([1, 2, 3, 1], dtype=torch.int64)
    steps = torch.tensor([0, 0, 0, 0], dtype=torch.int64)
    draws = counter_uniforms(seeds, steps)
    assert draws[0] == draws[3] and draws[0] != draws[1]
    assert torch.equal(counter_uniforms(seeds[:1], steps[:1]), draws[:1])  # batch-independent
    assert counter_uniforms(seeds[:1], steps[:1] + 1) != draws[0]
    many = counter_uniforms(torch.arange(50_000) * 7919, torch.arange(50_000) % 13)  # the tensor path
    assert float(many.min()) > 0 and float(many.max()) < 1
    histogram = torch.histc(many, bins=20, min=0, max=1)
    expected = many.numel() / 20
    chi2 = float(((histogram - expected) ** 2 / expected).sum())
    assert chi2 < 19 + 5 * math.sqrt(38), chi2
    assert (
        abs(float(torch.corrcoef(torch.stack([many[:-1], many[1:]]))[0, 1])) < 0.01
    )  # neighbours uncorrelated


def test_sampler_draws_follow_temperature_top_k_top_p():
    """100k streams at the sampler itself: frequencies match softmax(processed); removed tokens never appear."""
    from tandem.rollout.sampling import counter_uniforms, processed_logits, sample_tokens

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0, 0.5, -3.0, 1.5]])
    n, vocab = 100_000, logits.shape[-1]
    temperature, top_k, top_p = torch.full((n,), 0.7), torch.full((n,), 6), torch.full((n,), 0.97)
    processed = processed_logits(logits.expand(n, -1), temperature, top_k, top_p)
    uniforms = counter_uniforms(torch.arange(n) * 31 + 5, torch.full((n,), 3))
    tokens = sample_tokens(processed, torch.zeros(n, dtype=torch.bool), uniforms)
    counts = torch.bincount(tokens, minlength=vocab).double()
    probs = torch.softmax(processed[0], -1).double()
    removed = probs == 0
    assert removed.sum() >= 2 and counts[removed].sum() == 0
    expected = probs[~removed] * n
    chi2 = float(((counts[~removed] - expected) ** 2 / expected).sum())
    dof = int((~removed).sum()) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, counts, expected)


def test_sampling_at_the_edges_of_the_unit_interval_keeps_to_kept_tokens():
    from tandem.rollout.sampling import sample_tokens

    processed = torch.tensor([[float("-inf"), 0.0, 1.0, float("-inf")]] * 3)
    uniforms = torch.tensor([0.0, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    greedy = torch.tensor([False, True, False])
    assert sample_tokens(processed, greedy, uniforms).tolist() == [1, 2, 2]


def test_non_finite_probabilities_raise_instead_of_an_out_of_range_token():
    """A temperature that overflows the logits (1e-40 is below fp32's normal range) gives NaN
    probabilities; the sampler names the row rather than returning token id V."""
    from tandem.rollout.sampling import sample_tokens

    logits = torch.linspace(-5.0, 5.0, 103).repeat(3, 1)  # [3, V=103]
    temperature = torch.tensor([1e-40, 1.0, 1e-40])
    processed = processed_logits(logits, temperature, torch.zeros(3, dtype=torch.long), torch.ones(3))
    uniforms = torch.full((3,), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"not finite .* rows \[0, 2\]"):
        sample_tokens(processed, torch.zeros(3, dtype=torch.bool), uniforms)
    finite = processed_logits(
        logits, torch.tensor([0.0, 1.0, 1e-5]), torch.zeros(3, dtype=torch.long), torch.ones(3)
    )
    tokens = sample_tokens(finite, torch.tensor([True, False, False]), uniforms).tolist()
    assert tokens[0] == tokens[2] == 102 and 0 <= tokens[1] < 103  # 1e-5 is still finite: all but greedy


def test_row_keys_in_python_equal_the_tensor_path():
    """Small batches key their rows with Python ints; the vectorised int64 path is the reference."""
    from tandem.rollout.sampling import SMALL_BATCH_KEYS, _splitmix64, row_keys

    gen = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**62), 2**62, (SMALL_BATCH_KEYS,), generator=gen)
    seeds[:3] = torch.tensor([0, -1, 2**63 - 1])
    steps = torch.randint(0, 10_000, (SMALL_BATCH_KEYS,), generator=gen)
    assert torch.equal(row_keys(seeds, steps), _splitmix64(_splitmix64(seeds) ^ steps))
    wide_seeds, wide_steps = seeds.repeat(2), steps.repeat(2)  # over the threshold: the tensor path
    assert torch.equal(row_keys(wide_seeds, wide_steps)[:SMALL_BATCH_KEYS], row_keys(seeds, steps))


def test_on_token_sees_every_token_and_a_broken_listener_ends_only_its_request(qwen2_dir):
    engine = native(qwen2_dir)
    try:
        seen = []
        calls = []

        def broken(token, log_prob, version):
            calls.append(token)
            raise RuntimeError("listener bug")

        prompts = random_prompts(2, 11)
        params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=4)
        watched = engine.submit(
            RolloutRequest("watched", prompts[0], params), on_token=lambda *e: seen.append(e)
        )
        failing = engine.submit(RolloutRequest("failing", prompts[1], params), on_token=broken)
        completion, failed = watched.result(timeout=60), failing.result(timeout=60)
    finally:
        engine.close()
    assert seen == list(
        zip(completion.token_ids, completion.log_probs, completion.weight_versions, strict=True)
    )
    assert len(seen) == 20 and completion.finish_reason == "length"
    assert failed.finish_reason == "error" and "listener bug" in failed.error and len(calls) == 1


def test_a_seeded_hf_request_samples_by_its_seed_and_leaves_the_process_rng_alone(model_dir):
    hf = HFRolloutEngine.from_pretrained(model_dir)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = hf.generate_batch([RolloutRequest("a", (5, 6, 7), params)])[0]
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(456)  # another process state: the request's seed alone decides
    again = hf.generate_batch([RolloutRequest("b", (5, 6, 7), params)])[0]
    assert first.token_ids == again.token_ids
