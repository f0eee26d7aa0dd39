"""Buckets: named tensors laid out in one flat byte buffer, and the metadata to read them back.

The sender packs tensors (taken one at a time, so FSDP2 gathers one at a time) into buffers of
at most ``limit`` bytes — a larger tensor travels alone — and describes each bucket with a
:class:`BucketMeta`. A receiver turns a buffer and its meta back into ``(name, tensor)`` views
without copying.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

import torch

ALIGN = 64  # every tensor starts on a cache line, so any dtype views the buffer aligned


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor sits in a bucket: ``nbytes`` bytes from ``offset``, read as ``dtype`` ``shape``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketMeta:
    """Bucket ``index`` of one weight version: its tensors, total bytes, and where a transport put it.

    The bucket after the last holds no tensors and has ``last=True``.
    """

    index: int
    nbytes: int
    tensors: tuple[TensorSpec, ...]
    last: bool = False
    location: str = ""  # a file for the file-based transports

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> BucketMeta:
        raw = json.loads(text)
        tensors = tuple(
            TensorSpec(t["name"], tuple(t["shape"]), t["dtype"], t["offset"], t["nbytes"])
            for t in raw["tensors"]
        )
        return cls(raw["index"], raw["nbytes"], tensors, raw["last"], raw["location"])


def group_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], limit: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``limit`` bytes (a larger tensor alone), pulling one tensor at a time."""
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = _aligned(tensor.numel() * tensor.element_size())
        if group and size + nbytes > limit:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += nbytes
    if group:
        yield group


def layout(group: list[tuple[str, torch.Tensor]]) -> tuple[tuple[TensorSpec, ...], int]:
    """Each tensor's place in the bucket, and the bucket's size in bytes."""
    specs, offset = [], 0
    for name, tensor in group:
        nbytes = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        specs.append(TensorSpec(name, tuple(tensor.shape), dtype, offset, nbytes))
        offset += _aligned(nbytes)
    return tuple(specs), offset


@torch.no_grad()
def pack(buffer: torch.Tensor, group: list[tuple[str, torch.Tensor]], specs: tuple[TensorSpec, ...]) -> None:
    """Copy ``group``'s tensors into ``buffer`` (uint8, at least the bucket's size) at their offsets."""
    for (_, tensor), spec in zip(group, specs, strict=True):
        if spec.nbytes:
            target = buffer[spec.offset : spec.offset + spec.nbytes].view(tensor.dtype).view(tensor.shape)
            target.copy_(tensor)


def unpack(buffer: torch.Tensor, meta: BucketMeta) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, view)`` of each tensor in ``buffer`` (uint8); the views share the buffer's memory."""
    for spec in meta.tensors:
        raw = buffer[spec.offset : spec.offset + spec.nbytes]
        yield spec.name, raw.view(getattr(torch, spec.dtype)).view(spec.shape)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
