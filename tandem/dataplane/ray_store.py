"""The several-node engine: a block's fields are objects in Ray's object store.

``put`` stores each field's arrays (:mod:`tandem.dataplane.columns`) as one object of numpy
arrays: Ray pickles numpy arrays with out-of-band buffers, so the payload is written once
into the node's shared-memory object store and is never part of a pickle. ``get`` on the
block's own node maps those objects (no transfer) and copies out the rows asked for. On
another node it runs a small gather task *on the block's node* (node affinity) that cuts the
rows out there, and fetches only that result through Ray's object transfer: the bytes that
cross nodes are those of the asked fields of the asked rows. No transport of our own.

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

from tandem.dataplane.columns import WireColumn, encode, select_rows
from tandem.dataplane.store import check_fields, check_rows, count, decode_counted


@dataclass(frozen=True)
class RayBlock:
    """A block in Ray's object store: one object per field (``refs``, in ``columns`` order),
    put on node ``node_id`` by the store numbered ``key``."""

    node_id: str
    key: str
    rows: int
    columns: tuple[WireColumn, ...]
    refs: tuple[Any, ...]
    engine: str = "ray"


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


def _to_torch(entry: tuple[str, tuple[int, ...], np.ndarray], copy: bool) -> torch.Tensor:
    dtype, shape, raw = entry
    flat = (
        torch.from_numpy(np.array(raw, copy=True) if copy else raw)
        if raw.size
        else torch.empty(0, dtype=torch.uint8)
    )
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _reader(objects: Sequence[Mapping[str, Any]]):
    """``read(name, a, b)`` over mapped field objects: a copy of rows ``[a, b)``."""
    arrays: dict[str, Any] = {}
    for obj in objects:
        arrays.update(obj)

    def read(name: str, start: int, stop: int) -> torch.Tensor:
        dtype, shape, raw = arrays[name]
        torch_dtype = getattr(torch, dtype)
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * torch.empty(0, dtype=torch_dtype).element_size()
        part = np.array(raw[start * row_bytes : stop * row_bytes], copy=True)
        flat = torch.from_numpy(part) if part.size else torch.empty(0, dtype=torch.uint8)
        return flat.view(torch_dtype).reshape(max(stop - start, 0), *shape[1:])

    return read


def gather_rows(columns: tuple[WireColumn, ...], rows: np.ndarray, *objects: Mapping[str, Any]) -> dict:
    """Run on the block's node: the compact arrays of ``rows`` of ``columns``, as numpy for Ray."""
    return _to_numpy(select_rows(_reader(objects), columns, rows))


class RayStore:
    """Puts blocks into this node's part of Ray's object store and reads blocks from any node."""

    _keys = itertools.count()

    def __init__(self) -> None:
        ray = _ray()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.key = f"{ray.get_runtime_context().get_worker_id()}-{next(self._keys)}"
        self._held: dict[tuple, tuple[Any, ...]] = {}
        self._gather = ray.remote(num_cpus=0)(gather_rows)

    def put(self, tensors: Mapping[str, torch.Tensor]) -> RayBlock:
        """Encode ``tensors`` (each ``[N, ...]``) and ``ray.put`` one object per field."""
        ray = _ray()
        sizes = {t.shape[0] for t in tensors.values()}
        if len(sizes) != 1:
            raise ValueError(f"a block's fields need one row count, got {sorted(sizes)}")
        columns, arrays = encode(tensors)
        refs = tuple(ray.put(_to_numpy({n: arrays[n] for n in c.arrays()})) for c in columns)
        block = RayBlock(self.node_id, self.key, sizes.pop(), columns, refs)
        self._held[tuple(r.hex() for r in refs)] = refs
        count(put=sum(a.numel() * a.element_size() for a in arrays.values()), blocks_put=1)
        return block

    def get(self, block: RayBlock, fields: Sequence[str], rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """Padded ``[len(rows), ...]`` tensors of ``fields``; ``rows`` sorted and unique."""
        ray = _ray()
        columns = check_fields(block, fields)
        wanted = check_rows(block, rows)
        by_name = dict(zip((c.name for c in block.columns), block.refs, strict=True))
        refs = [by_name[c.name] for c in columns]
        if block.node_id == self.node_id:
            compact = select_rows(_reader(ray.get(refs)), columns, wanted)
        else:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # deferred: Ray

            task = self._gather.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(block.node_id, soft=False)
            ).remote(columns, wanted, *refs)
            compact = {name: _to_torch(entry, copy=True) for name, entry in ray.get(task).items()}
        return decode_counted(columns, compact, len(wanted))

    def release(self, block: RayBlock) -> None:
        """Drop this store's references to the block (Ray frees it when no reference is left)."""
        if self._held.pop(tuple(r.hex() for r in block.refs), None) is not None:
            count(released=1)

    @property
    def held_blocks(self) -> int:
        return len(self._held)
