"""Weight updates for vLLM travel in bounded buckets: every tensor arrives once, bit-exact."""

import io

import torch

from tandem.rollout.vllm_engine import weight_buckets


def _load(payload: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(payload), weights_only=True)


def test_buckets_hold_each_tensor_once_within_the_limit():
    gen = torch.Generator().manual_seed(0)
    named = [(f"layer{i}.weight", torch.randn(64, 32, generator=gen)) for i in range(10)]  # 8 KiB each
    named.append(("big.weight", torch.randn(256, 256, generator=gen)))  # 256 KiB: over the limit, alone
    named.append(("tail.bias", torch.randn(7, generator=gen).to(torch.bfloat16)))
    buckets = [_load(b) for b in weight_buckets(iter(named), limit_bytes=20 * 1024)]
    received = {name: tensor for bucket in buckets for name, tensor in bucket.items()}
    assert list(received) == [name for name, _ in named]
    for name, tensor in named:
        assert torch.equal(received[name], tensor) and received[name].dtype == tensor.dtype, name
    for bucket in buckets:
        sizes = [t.numel() * t.element_size() for t in bucket.values()]
        assert len(sizes) == 1 or sum(sizes) <= 20 * 1024
    assert [list(b) for b in buckets if "big.weight" in b] == [["big.weight"]]


def _views_of_one_buffer(named: list[tuple[str, torch.Tensor]]):
    """The receiver's contract (``WeightReceiver.receive``): each tensor is a view that the next
    request overwrites, as one reused broadcast buffer does."""
    buffer = torch.empty(max(t.numel() for _, t in named))
    for name, tensor in named:
        view = buffer[: tensor.numel()].view(tensor.shape)
        view.copy_(tensor)
        yield name, view
        buffer.fill_(float("nan"))  # the next bucket lands here


def test_buckets_own_their_tensors_when_the_source_reuses_its_buffer():
    gen = torch.Generator().manual_seed(1)
    named = [(f"layer{i}.weight", torch.randn(64, 32, generator=gen)) for i in range(6)]
    buckets = [_load(b) for b in weight_buckets(_views_of_one_buffer(named), limit_bytes=20 * 1024)]
    assert len(buckets) > 1  # grouping looks one tensor ahead of each bucket it yields
    received = {name: tensor for bucket in buckets for name, tensor in bucket.items()}
    for name, tensor in named:
        assert torch.equal(received[name], tensor), name


def test_buckets_carry_floating_tensors_as_the_receiving_parameters_would_round_them():
    """With ``dtype``, fp32 master weights travel as the bf16 that loading them into bf16
    parameters makes of them (the reference: ``copy_`` into a bf16 tensor), in half the bytes;
    integer tensors keep their dtype, and narrower ones are not widened."""
    gen = torch.Generator().manual_seed(2)
    named = [(f"layer{i}.weight", torch.randn(64, 32, generator=gen)) for i in range(4)]
    named.append(("positions", torch.arange(9)))
    as_is = list(weight_buckets(iter(named), limit_bytes=20 * 1024))
    cast = list(weight_buckets(iter(named), limit_bytes=20 * 1024, dtype=torch.bfloat16))
    received = {name: tensor for bucket in map(_load, cast) for name, tensor in bucket.items()}
    for name, tensor in named[:-1]:
        loaded = torch.empty(tensor.shape, dtype=torch.bfloat16).copy_(tensor)
        assert received[name].dtype == torch.bfloat16 and torch.equal(received[name], loaded), name
    assert received["positions"].dtype == torch.int64 and torch.equal(received["positions"], named[-1][1])
    assert sum(map(len, cast)) < 0.6 * sum(map(len, as_is))
    halves = [(name, t.to(torch.bfloat16)) for name, t in named[:-1]]
    widened = [_load(b) for b in weight_buckets(iter(halves), limit_bytes=20 * 1024, dtype=torch.float32)]
    assert {t.dtype for bucket in widened for t in bucket.values()} == {torch.bfloat16}  # never widened
