"""The trainer's batched-product causal attention against PyTorch's fused kernel: outputs and gradients."""

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.causal_attention import MAX_LENGTH, QueryOffsets, causal_attention


def packed_views(n: int, length: int, heads: int, kv_heads: int, dim: int, dtype=torch.float32):
    """q, k, v as the varlen attention hands them over: views into one gathered ``[n * L, heads, d]`` leaf."""
    leaf = torch.randn(n * length, heads + 2 * kv_heads, dim, dtype=dtype).requires_grad_()
    x = leaf.unflatten(0, (n, length)).transpose(1, 2)  # [n, all heads, L, d], not contiguous
    return leaf, x[:, :heads], x[:, heads : heads + kv_heads], x[:, heads + kv_heads :]


@pytest.mark.parametrize(
    ("n", "length", "heads", "kv_heads", "dim"),
    [(5, 17, 4, 2, 16), (3, 33, 4, 4, 8), (2, 64, 6, 1, 32), (16, 96, 4, 2, 64), (1, 1, 2, 1, 8)],
)
def test_equals_sdpa_outputs_and_gradients(n, length, heads, kv_heads, dim):
    torch.manual_seed(n * length)
    ours_leaf, q, k, v = packed_views(n, length, heads, kv_heads, dim)
    ref_leaf = ours_leaf.detach().clone().requires_grad_()
    x = ref_leaf.unflatten(0, (n, length)).transpose(1, 2)
    q_ref, k_ref, v_ref = x[:, :heads], x[:, heads : heads + kv_heads], x[:, heads + kv_heads :]
    grad = torch.randn(n, heads, length, dim)
    ours = causal_attention(q, k, v, 0.3)
    reference = F.scaled_dot_product_attention(
        q_ref, k_ref, v_ref, is_causal=True, scale=0.3, enable_gqa=heads != kv_heads
    )
    ours.backward(grad)
    reference.backward(grad)
    torch.testing.assert_close(ours, reference, atol=5e-6, rtol=1e-5)
    torch.testing.assert_close(ours_leaf.grad, ref_leaf.grad, atol=1e-5, rtol=1e-5)


def test_default_scale_is_one_over_sqrt_head_dim():
    _, q, k, v = packed_views(2, 9, 2, 2, 16)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(causal_attention(q, k, v, None), expected, atol=2e-6, rtol=1e-5)


def test_other_dtypes_long_sequences_and_dropout_take_the_fused_kernel():
    """bf16, sequences past MAX_LENGTH and dropout all match (or are) SDPA itself."""
    _, q, k, v = packed_views(2, 12, 4, 2, 8, dtype=torch.bfloat16)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5, enable_gqa=True)
    assert torch.equal(causal_attention(q, k, v, 0.5), expected)
    _, q, k, v = packed_views(1, MAX_LENGTH + 1, 2, 2, 8)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    assert torch.equal(causal_attention(q, k, v, 0.5), expected)
    _, q, k, v = packed_views(2, 12, 2, 2, 8)
    torch.manual_seed(0)
    dropped = causal_attention(q, k, v, 0.5, dropout_p=0.5)
    torch.manual_seed(0)
    assert torch.equal(
        dropped, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5, dropout_p=0.5)
    )


def test_mixed_dtypes_under_autocast_take_the_fused_kernel():
    """Under bf16 autocast, Qwen3's per-head norms hand over fp32 queries and keys beside bf16
    values: the batched products (whose backward runs outside autocast) would mix dtypes, so the
    fused kernel runs, forward and backward, as SDPA under autocast does."""
    torch.manual_seed(1)
    q, k = (torch.randn(2, 4, 12, 8, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 2, 12, 8, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 4, 12, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = causal_attention(q, k[:, :2], v, 0.5)
        expected = F.scaled_dot_product_attention(q, k[:, :2], v, is_causal=True, scale=0.5, enable_gqa=True)
    assert torch.equal(ours, expected)
    ours.backward(grad)
    assert q.grad is not None and v.grad.dtype == torch.bfloat16


def suffix_reference(q_full, k, v, offsets, q_len, scale):
    """Each sequence's queries at key positions ``offsets[s] ..`` from plain causal attention over
    all its keys (queries at every position), cut to the ``q_len`` rows after the offset."""
    full = F.scaled_dot_product_attention(
        q_full, k, v, is_causal=True, scale=scale, enable_gqa=q_full.shape[1] != k.shape[1]
    )
    return torch.stack([full[s, :, o : o + q_len] for s, o in enumerate(offsets.tolist())])


@pytest.mark.parametrize(
    ("k_len", "dtype"), [(40, torch.float32), (MAX_LENGTH + 8, torch.float32), (40, torch.float64)]
)
def test_query_suffixes_equal_rows_of_full_causal_attention(k_len, dtype):
    """Queries at the last positions only (the batched products, or SDPA with a mask past
    MAX_LENGTH and for other dtypes): outputs and gradients equal the matching rows of
    full causal attention."""
    n, heads, kv_heads, dim, q_len = 4, 4, 2, 16, 9
    torch.manual_seed(k_len)
    offsets = torch.tensor([0, 5, k_len - q_len, 17])
    q_full = torch.randn(n, heads, k_len, dim, dtype=dtype).requires_grad_()
    k = torch.randn(n, kv_heads, k_len, dim, dtype=dtype).requires_grad_()
    v = torch.randn(n, kv_heads, k_len, dim, dtype=dtype).requires_grad_()
    rows = torch.arange(q_len)
    q = (
        torch.stack([q_full[s, :, o + rows] for s, o in enumerate(offsets.tolist())])
        .detach()
        .requires_grad_()
    )
    k_ours, v_ours = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
    grad = torch.randn(n, heads, q_len, dim, dtype=dtype)
    ours = causal_attention(q, k_ours, v_ours, 0.25, offsets=QueryOffsets(offsets))
    reference = suffix_reference(q_full, k, v, offsets, q_len, 0.25)
    ours.backward(grad)
    reference.backward(grad)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-10, "rtol": 1e-10}
    torch.testing.assert_close(ours, reference, **tolerance)
    q_grad = torch.stack([q_full.grad[s, :, o + rows] for s, o in enumerate(offsets.tolist())])
    torch.testing.assert_close(q.grad, q_grad, **tolerance)
    torch.testing.assert_close(k_ours.grad, k.grad, **tolerance)
    torch.testing.assert_close(v_ours.grad, v.grad, **tolerance)


def test_fewer_queries_than_keys_need_offsets():
    _, q, k, v = packed_views(2, 9, 2, 2, 16)
    with pytest.raises(ValueError, match="4 queries over 9 keys need QueryOffsets"):
        causal_attention(q[:, :, :4], k, v, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tensors_take_the_fused_kernel():
    _, q, k, v = packed_views(2, 12, 4, 2, 8)
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5, enable_gqa=True)
    assert torch.equal(causal_attention(q, k, v, 0.5), expected)
