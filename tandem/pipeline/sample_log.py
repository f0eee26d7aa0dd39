"""The sample log beside a schedule record: every prompt group a replica hands over, kept for a replay.

With ``pipeline.record_schedule=PATH`` each rollout replica also appends every finished group it
reports (the arrays of its sample file: ``token_ids``, ``log_probs``, ``versions``, ``lengths``,
and ``routed_experts`` / an agent group's fields when present) to a file of its own in
:func:`log_directory` ``(PATH)``, ``replica<rank>-<pid>.log`` (one per process: a restarted
replica starts a new file, so a torn tail of the old one stays at its end). The replica writes
the entry, flushes and syncs it before it reports the group, and the group's metadata carries
the entry's reference (``<file>@<offset>``, :attr:`GroupMeta.sample_log`), which the schedule
record's line for the draw then names; so a record line never names an entry that is not on
disk. The controller handles no token for it.

One entry, appended (all integers little-endian)::

    b"TSL1" | header bytes: uint64 | payload bytes: uint64 | header (JSON) | payload | crc32: uint32

The header holds the group's ``uid`` and each array's wire column (``tandem.dataplane.columns``:
integers narrowed to the narrowest type that holds them, floats as their bits) and where its
stored arrays lie in the payload; the CRC covers header and payload. Reading an entry decodes it
back to the very tensors written, dtype and bits (:func:`read_entry`); :func:`read_log` walks a
file's entries and stops at a tail that a crash cut short (never reported, so never named).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from tandem.dataplane.columns import WireColumn, decode_columns, encode
from tandem.dataplane.windows import as_bits, numpy_dtype

MAGIC = b"TSL1"
_SIZES = struct.Struct("<4sQQ")  # magic, header bytes, payload bytes
_CRC = struct.Struct("<I")


def log_directory(record_path: str) -> str:
    """Where the replicas' sample logs of the schedule record ``record_path`` live: beside it."""
    return f"{record_path}.samples"


class SampleLog:
    """Appends entries to ``<directory>/replica<replica>-<pid>.log`` (made on first use)."""

    def __init__(self, directory: str, replica: int) -> None:
        self.directory = Path(directory)
        self.name = f"replica{replica}-{os.getpid()}.log"

    def append(self, uid: str, tensors: dict[str, torch.Tensor]) -> str:
        """Append group ``uid``'s ``tensors`` (CPU) as one entry, on disk when this returns; its
        reference, ``<file>@<offset>``."""
        columns, arrays = encode({name: t.detach().cpu() for name, t in tensors.items()})
        parts, stored, offset = [], [], 0
        for name, array in arrays.items():
            data = as_bits(array.contiguous()).tobytes()
            stored.append({"name": name, "dtype": str(array.dtype).removeprefix("torch."),
                           "shape": list(array.shape), "offset": offset, "nbytes": len(data)})  # fmt: skip
            parts.append(data)
            offset += len(data)
        header = json.dumps({"uid": uid, "columns": [asdict(c) for c in columns], "arrays": stored}).encode(
            "utf-8"
        )
        payload = b"".join(parts)
        entry = _SIZES.pack(MAGIC, len(header), len(payload)) + header + payload
        entry += _CRC.pack(zlib.crc32(header + payload))
        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / self.name).open("ab") as file:
            start = file.tell()
            file.write(entry)
            file.flush()
            os.fsync(file.fileno())
        return f"{self.name}@{start}"


def read_entry(directory: str, reference: str) -> tuple[str, dict[str, torch.Tensor]]:
    """The ``(uid, tensors)`` of the entry ``reference`` (``<file>@<offset>``) in ``directory``;
    an entry that is cut short or fails its CRC is an error naming it."""
    name, _, offset = reference.rpartition("@")
    if not name or not offset.isdigit() or os.sep in name:
        raise ValueError(f"sample log: {reference!r} is not a <file>@<offset> reference")
    path = Path(directory) / name
    with path.open("rb") as file:
        file.seek(int(offset))
        entry = _read_one(file)
    if entry is None:
        raise ValueError(f"sample log {path}: the entry at byte {offset} is cut short or corrupt")
    return entry


def read_log(path: str) -> list[tuple[int, str, dict[str, torch.Tensor]]]:
    """Every complete entry of the log file ``path`` as ``(offset, uid, tensors)``, in order; a
    last entry cut short (its replica died writing it) is left out."""
    entries = []
    with Path(path).open("rb") as file:
        while True:
            start = file.tell()
            entry = _read_one(file)
            if entry is None:
                break
            entries.append((start, *entry))
    return entries


def _read_one(file) -> tuple[str, dict[str, torch.Tensor]] | None:
    """The entry at ``file``'s position, or ``None`` when it is incomplete or corrupt (a torn tail)."""
    sizes = file.read(_SIZES.size)
    if len(sizes) < _SIZES.size:
        return None
    magic, header_bytes, payload_bytes = _SIZES.unpack(sizes)
    if magic != MAGIC:
        return None
    body = file.read(header_bytes + payload_bytes + _CRC.size)
    if len(body) < header_bytes + payload_bytes + _CRC.size:
        return None
    content, (crc,) = body[: -_CRC.size], _CRC.unpack(body[-_CRC.size :])
    if zlib.crc32(content) != crc:
        return None
    header = json.loads(content[:header_bytes].decode("utf-8"))
    payload = memoryview(content)[header_bytes:]
    arrays = {}
    for spec in header["arrays"]:
        data = payload[spec["offset"] : spec["offset"] + spec["nbytes"]]
        dtype = numpy_dtype(getattr(torch, spec["dtype"]))
        arrays[spec["name"]] = np.frombuffer(data, dtype=dtype).reshape(spec["shape"])
    columns = [
        WireColumn(**{**c, "shape": tuple(c["shape"]), "sources": tuple(c.get("sources", ()))})
        for c in header["columns"]
    ]
    columns_by_name = {c.name: c for c in columns}
    tensors = {}
    for column in columns:  # the fields may have different rows (a group's lengths, its tokens)
        stored = columns_by_name[column.sources[0]] if column.sources else column  # a source has its rows
        rows = len(arrays[f"{stored.name}.starts"] if stored.jagged else arrays[f"{stored.name}.values"])
        tensors[column.name] = decode_columns(columns, [column.name], arrays, np.arange(rows))[0][column.name]
    return header["uid"], tensors
