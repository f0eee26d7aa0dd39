"""Cascade decode attention (each shared prefix read once) against the plain decode attention over whole slots."""

import pytest
import torch

from tandem.models import TinyModelConfig, save_tiny_model
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, RolloutRequest, SamplingParams
from tandem.rollout.kv_cache import SlotKVCache, StepPlan, decode_step_attention
from tandem.rollout.shared_prefix import SharedPrefixes, group_by_prefix, prefix_groups, worth_sharing
from tests.rollout.test_native_engine import random_prompts


def shared_cache(groups, prefix_lengths, positions, kv_heads, dtype):
    """A cache whose groups' slots hold identical prefixes (as the engine's copies do) and their own tokens after."""
    torch.manual_seed(0)
    dim, max_len = 8, 48
    cache = SlotKVCache(1, 12, kv_heads, max_len, dim, dtype, torch.device("cpu"))
    for tensor in cache.keys + cache.values:
        tensor.normal_()
        for members, length in zip(groups, prefix_lengths, strict=True):
            for token in members[1:]:
                tensor[token, :, :length] = tensor[members[0], :, :length]
    return cache


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (2, 2), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_equals_plain_decode_attention(heads, kv_heads, dtype):
    groups = [[0, 3, 4], [1], [2, 5, 6, 7]]  # uneven sizes, a singleton, members not contiguous
    prefix_lengths = [9, 13, 5]
    positions = torch.tensor([20, 13, 5, 9, 31, 6, 11, 40])  # each at or after its prefix's end
    cache = shared_cache(groups, prefix_lengths, positions, kv_heads, dtype)
    plain_cache = shared_cache(groups, prefix_lengths, positions, kv_heads, dtype)
    query = torch.randn(8, heads, 8, dtype=dtype)
    key, value = torch.randn(8, kv_heads, 8, dtype=dtype), torch.randn(8, kv_heads, 8, dtype=dtype)
    shared = SharedPrefixes.from_groups(groups, [g[-1] for g in groups], prefix_lengths)
    got = decode_step_attention(StepPlan(cache, (), 0, positions, shared), 0, query, key, value, 0.4)
    expected = decode_step_attention(StepPlan(plain_cache, (), 0, positions), 0, query, key, value, 0.4)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(cache.keys[0], plain_cache.keys[0])  # the same cache writes


def test_groups_are_padded_and_indexed_per_token():
    shared = SharedPrefixes.from_groups([[2, 0], [1]], [0, 1], [4, 6])
    assert shared.members.tolist() == [[2, 0], [1, 1]]
    assert shared.group_of.tolist() == [0, 1, 0] and shared.rank_of.tolist() == [1, 0, 0]
    assert (shared.shortest, shared.longest) == (4, 6)


def test_sharing_pays_only_for_long_prompts_with_copies():
    assert worth_sharing([300, 300], [16, 16])
    assert not worth_sharing([33] * 8, [8] * 8)  # short prompts: the gathers cost what the reads save
    assert not worth_sharing([300] * 4, [1] * 4)  # nothing shared
    assert not worth_sharing([], [])


def test_sharing_rule_follows_the_measured_table():
    """docs/benchmarks.md's cascade table: 4 or 8 samples per prompt did not pay; 16 did, unless
    the sequences' own tokens outweigh the prompt."""
    for prompt in (52, 150, 250, 500):
        assert not worth_sharing([prompt] * 8, [4] * 8, own_tokens=16)  # 8 x 4: 1.05-1.29x
    assert not worth_sharing([52] * 4, [8] * 4, own_tokens=16)  # 4 x 8: 1.53x
    assert not worth_sharing([150] * 4, [8] * 4, own_tokens=16)  # 1.40x
    assert worth_sharing([52] * 2, [16] * 2, own_tokens=16)  # 2 x 16, 32 new tokens: 0.70x
    assert worth_sharing([500] * 2, [16] * 2, own_tokens=16)  # 0.53x
    assert not worth_sharing([52] * 2, [16] * 2, own_tokens=128)  # 2 x 16, 256 new tokens: 1.24x


def test_grouping_keys_on_prompt_and_weight_version():
    prompt, other = tuple(range(60)), tuple(range(1, 61))
    keys = [(0, prompt), (0, prompt), (1, prompt), (0, other), (0, prompt), (1, prompt)]
    assert prefix_groups(keys) == [[0, 1, 4], [2, 5], [3]]  # a new version is a new prefix
    many = keys * 8  # groups of 24, 16 and 8: enough copies to share
    shared = group_by_prefix(many, [60] * len(many))
    assert shared is not None
    assert shared.source.tolist() == [0, 2, 3]
    assert shared.members[2].tolist() == list(range(3, 48, 6)) + [3] * 16  # padded with its first member
    assert group_by_prefix(keys, [60] * 6) is None  # 2 copies per prompt: not worth it
    assert group_by_prefix([(0, prompt[:20])] * 8, [20] * 8) is None  # short: not worth it


def test_engine_with_shared_prefix_reads_equals_the_engine_without(tmp_path):
    """Long shared prompts, groups that shrink as members finish (slots move), a singleton, sampling."""
    path = save_tiny_model(tmp_path / "m", TinyModelConfig(family="qwen2", seed=4))
    prompts = random_prompts(3, 11, low=60, high=100)
    requests = [
        RolloutRequest(
            f"r{i}",
            prompts[min(i // 24, 2)],  # two groups of 24 (enough copies to share) and a singleton
            SamplingParams(temperature=1.0, max_tokens=6 + (i * 7) % 17, seed=i, ignore_eos=i % 2 == 0),
        )
        for i in range(49)
    ]
    results = {}
    for share in (True, False):
        engine = NativeRolloutEngine.from_pretrained(
            str(path), NativeEngineConfig(max_num_seqs=64, max_model_len=160, share_prefix_reads=share)
        )
        try:
            results[share] = engine.generate_batch(requests, timeout=120)
            assert (engine.stats.shared_prefix_steps > 0) == share
        finally:
            engine.close()
    for ours, plain in zip(results[True], results[False], strict=True):
        assert ours.token_ids == plain.token_ids
        assert max(abs(a - b) for a, b in zip(ours.log_probs, plain.log_probs, strict=True)) < 1e-5
