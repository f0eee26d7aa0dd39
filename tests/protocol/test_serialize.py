"""Serialisation: exact round trips for every dtype, no tensor pickling, clear errors."""

import pickle

import pytest
import torch

from tandem.protocol import Batch, from_bytes, to_buffers, to_bytes

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def random_tensor(dtype: torch.dtype, shape, gen) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 1e3).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=gen, dtype=torch.int64
    ).to(dtype)


def test_round_trip_is_exact_for_every_dtype():
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t_{str(d).split('.')[1]}": random_tensor(d, (4, 3, 2), gen) for d in DTYPES}
    tensors["empty"] = torch.zeros(4, 0)
    tensors["non_contiguous"] = torch.randn(3, 4, generator=gen).t()
    tensors["special"] = torch.tensor([[float("nan")], [float("inf")], [-0.0], [1e-45]])
    batch = Batch(
        tensors, {"uid": ["a", "b", "c", "d"], "info": [{"k": [1, 2]}, None, 3.5, "x"]}, {"version": 7}
    )
    restored = from_bytes(to_bytes(batch))
    assert set(restored.keys()) == set(batch.keys())
    for key, tensor in batch.tensors.items():
        out = restored[key]
        assert out.dtype == tensor.dtype and out.shape == tensor.shape
        # Compare raw bits so NaN and -0.0 count as exact.
        assert torch.equal(out.contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), key
    assert list(restored["info"]) == list(batch["info"]) and restored.meta == {"version": 7}


def test_tensor_payloads_are_not_pickled():
    big = torch.arange(10_000, dtype=torch.float32).reshape(10, 1000)
    header, buffers = to_buffers(Batch({"big": big}))
    # The only pickle is the small object blob (non-tensor columns + meta), not the 40 kB payload.
    assert buffers[0].nbytes == big.numel() * 4 and bytes(buffers[0]) == big.numpy().tobytes()
    assert len(bytes(buffers[-1])) < 200 and pickle.loads(bytes(buffers[-1])) == {
        "non_tensors": {},
        "meta": {},
    }
    assert len(header) < 300


def test_writable_buffer_is_shared_without_copy():
    data = bytearray(to_bytes(Batch({"x": torch.zeros(2, 3)})))
    batch = from_bytes(data)
    batch["x"][0, 0] = 5.0
    assert from_bytes(bytes(data))["x"][0, 0] == 5.0


def test_bad_inputs_are_clear_errors():
    good = to_bytes(Batch({"x": torch.ones(2, 2)}))
    with pytest.raises(ValueError, match="magic"):
        from_bytes(b"NOPE" + good[4:])
    with pytest.raises(ValueError, match="truncated"):
        from_bytes(good[:-10])
    with pytest.raises(ValueError, match="truncated"):
        from_bytes(good[:5])
    with pytest.raises(ValueError, match="meta key 'w'"):
        to_bytes(Batch({"x": torch.ones(2, 2)}, meta={"w": torch.ones(1)}))
