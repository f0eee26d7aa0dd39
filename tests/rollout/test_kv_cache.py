"""The batched decode attention against one SDPA call per sequence on its own cached tokens; decode cache writes."""

import pytest
import torch
import torch.nn.functional as F

from tandem.rollout.kv_cache import SlotKVCache, StepPlan, decode_attention, decode_step_attention


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_per_sequence_sdpa(heads, kv_heads, dtype):
    torch.manual_seed(0)
    count, dim, max_len = 5, 16, 40
    cache = SlotKVCache(1, 8, kv_heads, max_len, dim, dtype, torch.device("cpu"))
    cache.keys[0].normal_()
    cache.values[0].normal_()
    positions = torch.tensor([3, 0, 17, 9, 17])  # each token sees positions 0..its own
    plan = StepPlan(cache, (), 0, positions)
    query = torch.randn(count, heads, dim, dtype=dtype)
    length = plan.decode_length
    got = decode_attention(
        query, cache.keys[0][:count, :, :length], cache.values[0][:count, :, :length], plan.decode_bias, 0.3
    )
    for i, position in enumerate(positions.tolist()):
        seen = slice(0, position + 1)
        expected = F.scaled_dot_product_attention(
            query[i].float().unsqueeze(1),  # [H, 1, d]
            cache.keys[0][i, :, seen].float(),
            cache.values[0][i, :, seen].float(),
            scale=0.3,
            enable_gqa=heads != kv_heads,
        ).squeeze(1)
        tolerance = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[i].float(), expected, atol=tolerance, rtol=tolerance)


def test_decode_bias_hides_positions_after_each_token():
    cache = SlotKVCache(1, 4, 2, 16, 8, torch.float32, torch.device("cpu"))
    plan = StepPlan(cache, (), 0, torch.tensor([2, 0]))
    bias = plan.decode_bias  # [2 tokens * 2 kv heads, 1, 3]
    assert bias.shape == (4, 1, 3)
    assert bias[:2].eq(0).all()  # token 0 (position 2) sees 0..2 for both heads
    assert bias[2:, 0, 0].eq(0).all() and bias[2:, 0, 1:].eq(float("-inf")).all()


def test_decode_step_attention_writes_each_token_at_its_slot_and_position():
    """Flat-row writes land where ``cache[slot, :, position] = key`` puts them; attention then sees them."""
    torch.manual_seed(1)
    kv_heads, dim = 2, 8
    cache = SlotKVCache(2, 6, kv_heads, 12, dim, torch.float32, torch.device("cpu"))
    positions = torch.tensor([4, 0, 11])
    plan = StepPlan(cache, (), 0, positions)
    query, key, value = torch.randn(3, 4, dim), torch.randn(3, kv_heads, dim), torch.randn(3, kv_heads, dim)
    expected_keys = cache.keys[1].clone()
    for slot, position in enumerate(positions.tolist()):
        expected_keys[slot, :, position] = key[slot]
    got = decode_step_attention(plan, 1, query, key, value, 0.5)
    torch.testing.assert_close(cache.keys[1], expected_keys, atol=0, rtol=0)
    assert cache.keys[0].eq(0).all()  # other layers untouched
    assert torch.equal(cache.values[1][2, :, 11], value[2])
    # slot 1 sees only position 0: its own value, whatever the scores
    torch.testing.assert_close(got[1], value[1].repeat_interleave(2, dim=0), atol=1e-6, rtol=1e-6)


def test_copy_slots_copies_each_prefix_in_every_layer():
    cache = SlotKVCache(2, 6, 2, 10, 4, torch.float32, torch.device("cpu"))
    for tensor in cache.keys + cache.values:
        tensor.normal_()
    before = [t.clone() for t in cache.keys + cache.values]
    cache.copy_slots([0, 3], [5, 1], 7)
    for old, new in zip(before, cache.keys + cache.values, strict=True):
        assert torch.equal(new[5, :, :7], old[0, :, :7]) and torch.equal(new[1, :, :7], old[3, :, :7])
        assert torch.equal(new[[0, 2, 3, 4]], old[[0, 2, 3, 4]])  # sources and bystanders unchanged
        assert torch.equal(new[5, :, 7:], old[5, :, 7:])  # nothing past the copied window
