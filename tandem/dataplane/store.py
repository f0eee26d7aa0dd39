"""The store's one narrow interface, its block references and this process's byte counters.

A *block* is the per-token fields of some rows, put by the process that produced them into
a store on its own node. Three calls:

* ``put(tensors) -> Block``: encode the fields (:mod:`tandem.dataplane.columns`) and store them;
* ``get(block, fields, rows) -> {field: tensor}``: the padded ``[len(rows), ...]`` tensors of
  ``fields`` of ``rows``, fetching only those fields' bytes of those rows;
* ``release(block)``: free the block (idempotent).

Engines: :class:`~tandem.dataplane.shm.ShmStore` (one file per block in ``/dev/shm``) and
:class:`~tandem.dataplane.ray_store.RayStore` (Ray's object store, across nodes).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tandem.dataplane.columns import WireColumn, decode, payload_nbytes


class Block(Protocol):
    """A stored block: its rows, its fields' wire columns and the engine that reads it."""

    engine: str
    rows: int
    columns: tuple[WireColumn, ...]


class Store(Protocol):
    """What every engine provides (see the module docstring)."""

    def put(self, tensors: Mapping[str, torch.Tensor]) -> Block: ...

    def get(self, block: Block, fields: Sequence[str], rows: Sequence[int]) -> dict[str, torch.Tensor]: ...

    def release(self, block: Block) -> None: ...


@dataclass(frozen=True)
class Traffic:
    """Bytes this process put into stores and fetched from them, and how many blocks it put and
    released.

    ``fetched_bytes`` counts the asked fields' values of the asked rows; ``fetched_index_bytes``
    the int32 length and start delivered with each row of a jagged field (8 bytes a row; the shm
    engine computes them from the int64 offsets it reads, one more than the rows of each run).
    """

    put_bytes: int = 0
    fetched_bytes: int = 0
    fetched_index_bytes: int = 0
    blocks_put: int = 0
    blocks_released: int = 0

    def __sub__(self, earlier: Traffic) -> Traffic:
        return Traffic(*(a - b for a, b in zip(self.astuple(), earlier.astuple(), strict=True)))

    def astuple(self) -> tuple[int, ...]:
        return (
            self.put_bytes,
            self.fetched_bytes,
            self.fetched_index_bytes,
            self.blocks_put,
            self.blocks_released,
        )


_lock = threading.Lock()
_counts = [0, 0, 0, 0, 0]


def count(put: int = 0, fetched: int = 0, index: int = 0, blocks_put: int = 0, released: int = 0) -> None:
    """Add to this process's counters (the engines call this)."""
    with _lock:
        for i, value in enumerate((put, fetched, index, blocks_put, released)):
            _counts[i] += value


def traffic() -> Traffic:
    """This process's counters since it started; subtract two readings for a window."""
    with _lock:
        return Traffic(*_counts)


def check_fields(block: Block, fields: Sequence[str]) -> tuple[WireColumn, ...]:
    """The wire columns of ``fields`` in ``block``; a field it lacks is a ``KeyError`` naming both."""
    by_name = {c.name: c for c in block.columns}
    missing = [f for f in fields if f not in by_name]
    if missing:
        raise KeyError(f"block has no fields {missing}; it holds {sorted(by_name)}")
    return tuple(by_name[f] for f in fields)


def check_rows(block: Block, rows: Sequence[int]) -> np.ndarray:
    """``rows`` as int64, checked to lie in the block, sorted and unique (what the engines read)."""
    wanted = np.asarray(rows, dtype=np.int64).reshape(-1)
    if wanted.size and (wanted.min() < 0 or wanted.max() >= block.rows):
        raise IndexError(f"rows {wanted.min()}..{wanted.max()} are outside the block's {block.rows} rows")
    unique = np.unique(wanted)
    if len(unique) != len(wanted) or (len(wanted) and not np.all(np.diff(wanted) > 0)):
        raise ValueError("get takes sorted, unique rows; the reference batch expands repeats itself")
    return unique


def decode_counted(
    columns: Sequence[WireColumn], compact: Mapping[str, torch.Tensor], rows: int
) -> dict[str, torch.Tensor]:
    """Count the fetched compact arrays, then decode them into padded tensors."""
    payload, index = payload_nbytes(compact)
    count(fetched=payload, index=index)
    return {c.name: decode(c, compact, rows) for c in columns}
