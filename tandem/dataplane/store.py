"""The store's one narrow interface, its block references and this process's byte counters.

A *block* is the per-token fields of some rows, put by the process that produced them into
a store on its own node. Three calls:

* ``put(tensors) -> Block``: encode the fields (:mod:`tandem.dataplane.columns`; tensors, or
  ``UnpaddedField`` s never built padded) and store them;
* ``get(block, fields, rows) -> {field: tensor}``: the padded ``[len(rows), ...]`` tensors of
  ``fields`` of ``rows``, fetching only those fields' bytes of those rows;
* ``release(block)``: free the block (idempotent).

Engines: :class:`~tandem.dataplane.shm.ShmStore` (one file per block in ``/dev/shm``) and
:class:`~tandem.dataplane.ray_store.RayStore` (Ray's object store, across nodes).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from tandem.dataplane.columns import StoredArrays, UnpaddedField, WireColumn, decode_columns, read_columns


class Block(Protocol):
    """A stored block: its rows, its fields' wire columns and the engine that reads it."""

    engine: str
    rows: int
    columns: tuple[WireColumn, ...]


class Store(Protocol):
    """What every engine provides (see the module docstring)."""

    def put(self, tensors: Mapping[str, torch.Tensor | UnpaddedField]) -> Block: ...

    def get(self, block: Block, fields: Sequence[str], rows: Sequence[int]) -> dict[str, torch.Tensor]: ...

    def release(self, block: Block) -> None: ...


@dataclass(frozen=True)
class Traffic:
    """Bytes this process put into stores and fetched from them, and how many blocks it put and
    released.

    ``fetched_bytes`` counts the stored values read for the asked fields of the asked rows (a
    derived field's sources', :mod:`tandem.dataplane.derived`; none of a field stored without
    values), and ``fetched_by_field`` the same bytes by the stored field read (``{name: bytes}``,
    fields never read absent); ``fetched_index_bytes`` the int32 length and start delivered with
    each row of a jagged field read (8 bytes a row; the engines compute them from the int64
    offsets they read).
    """

    put_bytes: int = 0
    fetched_bytes: int = 0
    fetched_index_bytes: int = 0
    blocks_put: int = 0
    blocks_released: int = 0
    fetched_by_field: Mapping[str, int] = field(default_factory=dict)

    def __sub__(self, earlier: Traffic) -> Traffic:
        """The counts of the window between ``earlier`` and this reading (fields whose count did
        not change are left out of ``fetched_by_field``)."""
        by_field = {
            name: n - earlier.fetched_by_field.get(name, 0)
            for name, n in self.fetched_by_field.items()
            if n != earlier.fetched_by_field.get(name, 0)
        }
        return Traffic(*(a - b for a, b in zip(self.astuple(), earlier.astuple(), strict=True)), by_field)

    def astuple(self) -> tuple[int, ...]:
        """The totals, in field order (``fetched_by_field`` aside)."""
        return (
            self.put_bytes,
            self.fetched_bytes,
            self.fetched_index_bytes,
            self.blocks_put,
            self.blocks_released,
        )


_lock = threading.Lock()
_counts = [0, 0, 0, 0, 0]
_by_field: dict[str, int] = {}


def count(put: int = 0, fetched: int = 0, index: int = 0, blocks_put: int = 0, released: int = 0) -> None:
    """Add to this process's counters (the engines call this; fetches go through
    :func:`count_fetched`, which also counts them by field)."""
    with _lock:
        for i, value in enumerate((put, fetched, index, blocks_put, released)):
            _counts[i] += value


def count_fetched(by_field: Mapping[str, int], index: int) -> None:
    """Count one fetch: ``by_field`` the payload bytes read of each field, ``index`` its rows'
    lengths and starts. A dict add per field."""
    with _lock:
        for name, nbytes in by_field.items():
            _by_field[name] = _by_field.get(name, 0) + nbytes
            _counts[1] += nbytes
        _counts[2] += index


def traffic() -> Traffic:
    """This process's counters since it started; subtract two readings for a window."""
    with _lock:
        return Traffic(*_counts, dict(_by_field))


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


def decode_rows(
    columns: Sequence[WireColumn], arrays: StoredArrays, rows: np.ndarray, fields: Sequence[str] | None = None
) -> dict[str, torch.Tensor]:
    """The padded ``[len(rows), ...]`` tensors of ``fields`` (default: every column) of a block of
    ``columns``, decoded straight from its ``arrays`` (``rows`` sorted, unique; see
    :func:`~tandem.dataplane.columns.decode_columns`: a derived field's sources are read, it is
    built here); the fetch is counted, by the stored field read."""
    fields = [c.name for c in columns] if fields is None else list(fields)
    tensors, by_field = decode_columns(columns, fields, arrays, rows)
    jagged = sum(c.jagged for c in read_columns(columns, fields))
    count_fetched(by_field, index=8 * len(rows) * jagged)
    return tensors
