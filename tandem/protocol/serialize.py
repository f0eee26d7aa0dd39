"""Byte serialisation of a :class:`Batch` without pickling tensor payloads.

Layout (all integers little-endian)::

    b"TNDM" | u32 format version | u64 header length | header (JSON, utf-8) | pad to 64 | buffers

The header lists each tensor's name, dtype, shape, offset and byte length inside the
buffer area, plus the offset of one small pickle holding the non-tensor columns and the
batch meta (strings, dicts, numbers; tensors are refused there). Tensor buffers are the
raw bytes of contiguous tensors, 64-byte aligned, so a receiver can map them back with
``torch.frombuffer`` without a copy and the round trip is bit-exact for every dtype
(bfloat16 included, which numpy cannot represent).
"""

from __future__ import annotations

import copyreg
import json
import pickle
import struct
from typing import Any

import torch

from tandem.protocol.batch import Batch
from tandem.protocol.traffic import count_batch_bytes

MAGIC = b"TNDM"
FORMAT_VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<4sIQ")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"serialised batch names an unknown dtype {name!r}")
    return dtype


def to_buffers(batch: Batch) -> tuple[bytes, list[memoryview]]:
    """Header bytes and the list of payload buffers (views of the tensors' memory, no copy).

    Concatenating the header with each buffer placed at its 64-byte aligned offset gives
    the same bytes as :func:`to_bytes`; transports that scatter-gather can send the
    buffers as they are.
    """
    for key, value in batch.meta.items():
        if isinstance(value, torch.Tensor):
            raise ValueError(f"meta key {key!r} holds a tensor; per-sample tensors go in tensor fields")
    objects = pickle.dumps(
        {"non_tensors": {k: list(v) for k, v in batch.non_tensors.items()}, "meta": batch.meta},
        protocol=pickle.HIGHEST_PROTOCOL,
    )
    buffers: list[memoryview] = []
    entries: list[dict[str, Any]] = []
    offset = 0
    for name, tensor in batch.tensors.items():
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        raw = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
        entries.append(
            {
                "name": name,
                "dtype": _dtype_name(tensor.dtype),
                "shape": list(tensor.shape),
                "offset": offset,
                "nbytes": raw.nbytes,
            }
        )
        buffers.append(raw)
        offset = _aligned(offset + raw.nbytes)
    count_batch_bytes(serialised=sum(buffer.nbytes for buffer in buffers) + len(objects))
    header = {
        "batch_size": batch.batch_size,
        "tensors": entries,
        "objects": {"offset": offset, "nbytes": len(objects)},
    }
    buffers.append(memoryview(objects))
    header_json = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_json)) + header_json, buffers


def to_bytes(batch: Batch) -> bytes:
    """Serialise ``batch`` into one bytes object (see the module docstring for the layout)."""
    header, buffers = to_buffers(batch)
    parsed = json.loads(header[_PREFIX.size :])
    offsets = [e["offset"] for e in parsed["tensors"]] + [parsed["objects"]["offset"]]
    start = _aligned(len(header))
    total = start + (offsets[-1] + buffers[-1].nbytes)
    out = bytearray(total)
    out[: len(header)] = header
    for off, buf in zip(offsets, buffers, strict=True):
        out[start + off : start + off + buf.nbytes] = buf
    return bytes(out)


def from_bytes(data: bytes | bytearray | memoryview) -> Batch:
    """Rebuild a batch from :func:`to_bytes` output; exact for every dtype.

    With a writable buffer (``bytearray``) the tensors share its memory; a read-only one
    (``bytes``) is copied once so the resulting tensors are writable.
    """
    view = memoryview(data)
    if view.nbytes < _PREFIX.size:
        raise ValueError(f"serialised batch is truncated: {view.nbytes} bytes")
    magic, version, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise ValueError(f"not a serialised tandem Batch (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise ValueError(f"serialised batch has format version {version}; this tandem reads {FORMAT_VERSION}")
    header = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + header_len]))
    start = _aligned(_PREFIX.size + header_len)
    objects_end = start + header["objects"]["offset"] + header["objects"]["nbytes"]
    if view.nbytes < objects_end:
        raise ValueError(f"serialised batch is truncated: {view.nbytes} bytes, header expects {objects_end}")
    if view.readonly:
        view = memoryview(bytearray(view))
    tensors = {}
    for entry in header["tensors"]:
        dtype = _dtype_from_name(entry["dtype"])
        begin = start + entry["offset"]
        if entry["nbytes"] == 0:
            tensors[entry["name"]] = torch.empty(entry["shape"], dtype=dtype)
            continue
        raw = torch.frombuffer(view[begin : begin + entry["nbytes"]], dtype=torch.uint8)
        tensors[entry["name"]] = raw.view(dtype).reshape(entry["shape"])
    count_batch_bytes(
        deserialised=sum(entry["nbytes"] for entry in header["tensors"]) + header["objects"]["nbytes"]
    )
    obj_begin = start + header["objects"]["offset"]
    objects = pickle.loads(view[obj_begin:objects_end])
    return Batch(tensors, objects["non_tensors"], objects["meta"], batch_size=header["batch_size"])


def _reduce_batch(batch: Batch) -> tuple:
    """Pickle a :class:`Batch` through :func:`to_bytes`: its tensor payloads travel as raw buffers.

    Process pipes and Ray pickle what they send; registering this reducer (below) keeps every
    transport on the one exact format. It is registered here, beside the format, rather than as
    ``Batch.__reduce__``, so that the batch module needs nothing from this one.
    """
    return (from_bytes, (bytearray(to_bytes(batch)),))


copyreg.pickle(Batch, _reduce_batch)
