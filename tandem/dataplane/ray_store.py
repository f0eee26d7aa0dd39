"""The several-node engine: a block's fields are objects in Ray's object store.

``put`` stores each field's arrays (:mod:`tandem.dataplane.columns`) as one object of numpy
arrays: Ray pickles numpy arrays with out-of-band buffers, so the payload is written once
into the node's shared-memory object store and is never part of a pickle. ``get`` on the
block's own node maps those objects (``ray.get`` of a numpy array in the object store is a
read-only view of it, no transfer, no copy) and decodes the asked rows straight from those views
into the padded tensors it returns, one pass per field, as the shared-memory engine decodes from
its file's map (:func:`~tandem.dataplane.store.decode_rows`). On another node it runs a small
gather task *on the block's node* (node affinity) that cuts the rows out there, and fetches only
that result through Ray's object transfer: the bytes that cross nodes are those of the asked
fields of the asked rows (values, an int32 length and start a row). The result, mapped from the
reader's node's object store, is decoded the same way. No transport of our own.

Ray keeps an object while any reference to it lives; the store that put a block holds its
references until :meth:`RayStore.release` (run in the putting process) drops them.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tandem.dataplane.columns import StoredArrays, UnpaddedField, WireColumn, encode, read_columns, runs
from tandem.dataplane.store import check_fields, check_rows, count, decode_rows
from tandem.dataplane.windows import numpy_dtype


@dataclass(frozen=True)
class RayBlock:
    """A block in Ray's object store: one object per stored field (``refs``, in ``columns`` order,
    a derived field, which stores nothing, left out), put on node ``node_id`` by the store
    numbered ``key``."""

    node_id: str
    key: str
    rows: int
    columns: tuple[WireColumn, ...]
    refs: tuple[Any, ...]
    engine: str = "ray"
    nbytes: int = 0  # the encoded arrays' bytes in the object store (what a byte bound counts)


def _ray() -> Any:
    import ray  # deferred: Ray is an optional dependency, needed only by this engine

    if not ray.is_initialized():
        raise RuntimeError(
            "dataplane.engine=ray needs a connected Ray (run inside a Ray worker or ray.init())"
        )
    return ray


def _to_numpy(arrays: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    """Arrays as ``(dtype, shape, raw uint8 numpy)``: every torch dtype (bfloat16 too) travels as bytes."""
    return {
        name: (
            str(a.dtype).removeprefix("torch."),
            tuple(a.shape),
            a.contiguous().reshape(-1).view(torch.uint8).numpy(),
        )
        for name, a in arrays.items()
    }


def stored_arrays(objects: Sequence[Mapping[str, tuple[str, tuple[int, ...], np.ndarray]]]) -> StoredArrays:
    """The arrays of mapped field objects (``ray.get`` of :func:`_to_numpy` outputs) as
    :func:`~tandem.dataplane.windows.numpy_dtype` reads them: views of the object store's memory."""
    arrays: dict[str, np.ndarray] = {}
    for obj in objects:
        for name, (dtype, shape, raw) in obj.items():
            kind = numpy_dtype(getattr(torch, dtype))
            arrays[name] = raw.view(kind).reshape(shape) if raw.size else np.empty(shape, dtype=kind)
    return arrays


def gather_rows(columns: tuple[WireColumn, ...], rows: np.ndarray, *objects: Mapping[str, Any]) -> dict:
    """Run on the block's node: the compact numpy arrays of ``rows`` (sorted, unique) of
    ``columns``, cut from views of the mapped ``objects`` in one copy (a run of consecutive rows
    is one slice): per jagged field ``values`` of the rows, ``lengths [n] int32`` and
    ``starts [n] int32``; per dense field ``values [n, ...]``."""
    arrays, spans, out = stored_arrays(objects), runs(rows), {}
    for column in columns:
        name = column.name
        if not column.jagged:
            values = arrays[f"{name}.values"]
            out[f"{name}.values"] = _joined([values[a:b] for a, b in spans], values)
            continue
        offsets = arrays[f"{name}.offsets"]
        if column.constant_bits is None:
            values = arrays[f"{name}.values"]
            out[f"{name}.values"] = _joined([values[offsets[a] : offsets[b]] for a, b in spans], values)
        out[f"{name}.lengths"] = (offsets[rows + 1] - offsets[rows]).astype(np.int32)
        out[f"{name}.starts"] = np.ascontiguousarray(arrays[f"{name}.starts"][rows])
    return out


def _joined(parts: list[np.ndarray], like: np.ndarray) -> np.ndarray:
    return np.concatenate(parts) if parts else like[:0].copy()


def gathered_arrays(columns: Sequence[WireColumn], gathered: Mapping[str, np.ndarray]) -> StoredArrays:
    """A gather task's result (``ray.get`` of :func:`gather_rows`) as the arrays of a block of
    its rows alone, in order: each jagged field's ``offsets [n + 1]`` rebuilt from its lengths."""
    arrays = dict(gathered)
    for column in columns:
        if column.jagged:
            lengths = arrays.pop(f"{column.name}.lengths")
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            arrays[f"{column.name}.offsets"] = offsets
    return arrays


def _stored(columns: Sequence[WireColumn]) -> list[WireColumn]:
    """The columns that store arrays (one object each): all but the derived ones."""
    return [c for c in columns if not c.sources]


class RayStore:
    """Puts blocks into this node's part of Ray's object store and reads blocks from any node."""

    _keys = itertools.count()

    def __init__(self) -> None:
        ray = _ray()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.key = f"{ray.get_runtime_context().get_worker_id()}-{next(self._keys)}"
        self._held: dict[tuple, tuple[Any, ...]] = {}
        self._gather = ray.remote(num_cpus=0)(gather_rows)

    def put(self, tensors: Mapping[str, torch.Tensor | UnpaddedField]) -> RayBlock:
        """Encode ``tensors`` (each ``[N, ...]``) and ``ray.put`` one object per field."""
        ray = _ray()
        sizes = {t.shape[0] for t in tensors.values()}
        if len(sizes) != 1:
            raise ValueError(f"a block's fields need one row count, got {sorted(sizes)}")
        columns, arrays = encode(tensors)
        refs = tuple(ray.put(_to_numpy({n: arrays[n] for n in c.arrays()})) for c in _stored(columns))
        nbytes = sum(a.numel() * a.element_size() for a in arrays.values())
        block = RayBlock(self.node_id, self.key, sizes.pop(), columns, refs, nbytes=nbytes)
        self._held[tuple(r.hex() for r in refs)] = refs
        count(put=nbytes, blocks_put=1)
        return block

    def get(self, block: RayBlock, fields: Sequence[str], rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """Padded ``[len(rows), ...]`` tensors of ``fields``; ``rows`` sorted and unique."""
        ray = _ray()
        check_fields(block, fields)
        wanted = check_rows(block, rows)
        columns = read_columns(block.columns, fields)  # a derived field's sources instead of it
        by_name = dict(zip((c.name for c in _stored(block.columns)), block.refs, strict=True))
        refs = [by_name[c.name] for c in columns]
        if block.node_id == self.node_id:
            return decode_rows(block.columns, stored_arrays(ray.get(refs)), wanted, fields)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # deferred: Ray

        task = self._gather.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(block.node_id, soft=False)
        ).remote(columns, wanted, *refs)
        gathered = gathered_arrays(columns, ray.get(task))
        return decode_rows(block.columns, gathered, np.arange(len(wanted)), fields)

    def release(self, block: RayBlock) -> None:
        """Drop this store's references to the block (Ray frees it when no reference is left)."""
        if self._held.pop(tuple(r.hex() for r in block.refs), None) is not None:
            count(released=1)

    @property
    def held_blocks(self) -> int:
        return len(self._held)
