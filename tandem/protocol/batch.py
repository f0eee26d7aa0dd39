"""``Batch``: the one container that carries data between every stage of a training step.

A batch has three parts, kept apart on purpose:

* ``tensors``: a :class:`tensordict.TensorDict` whose batch dimension (dim 0, size ``B``) is
  shared by every tensor;
* ``non_tensors``: per-sample Python objects (strings, dicts, message lists) stored as 1-D
  object arrays of length ``B``;
* ``meta``: batch-level information (e.g. the weight version a rollout ran under, timing).
  Hyperparameters do not belong here: they travel in configs.

Every operation is pure: it returns a new ``Batch`` and never mutates its input (tensors
may be shared between input and output where no copy is needed, as with ``select``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from tandem.device import to_device
from tandem.protocol.fields import check_standard_field

Index = int | slice | torch.Tensor | np.ndarray | Sequence[int]


def _object_column(name: str, values: Any, batch_size: int | None) -> np.ndarray:
    """Turn per-sample ``values`` into a 1-D object array, checking its length."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        column = values
    else:
        values = list(values)
        column = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):  # element-wise so lists stay objects, not a 2-D array
            column[i] = value
    if batch_size is not None and len(column) != batch_size:
        raise ValueError(
            f"non-tensor field {name!r} has {len(column)} samples, expected batch size {batch_size}"
        )
    for value in column:
        if isinstance(value, torch.Tensor):
            raise ValueError(f"non-tensor field {name!r} holds a torch.Tensor; put tensors in tensor fields")
    return column


def _to_numpy_index(index: Any) -> Any:
    if isinstance(index, torch.Tensor):
        return index.cpu().numpy()
    return index


class RowPieces:
    """``split`` and ``chunk`` for any row container with ``batch_size`` and slicing by rows
    (:class:`Batch`, and the data plane's ``BatchRef``)."""

    __slots__ = ()

    def split(self, size: int) -> list:
        """Consecutive pieces of ``size`` samples each; the last may be smaller (like ``torch.split``)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self[start : start + size] for start in range(0, self.batch_size, size)]

    def chunk(self, chunks: int) -> list:
        """``chunks`` equal consecutive pieces; the batch size must divide (see ``pad_to_divisor``)."""
        if chunks <= 0:
            raise ValueError(f"number of chunks must be positive, got {chunks}")
        if self.batch_size % chunks:
            raise ValueError(
                f"batch size {self.batch_size} is not divisible into {chunks} chunks; "
                f"use pad_to_divisor({chunks}) first and unpad after"
            )
        return self.split(self.batch_size // chunks)


class Batch(RowPieces):
    """Tensors, per-sample objects and batch metadata sharing one batch dimension.

    Args:
        tensors: name -> tensor, each with the batch dimension first (size ``B``).
        non_tensors: name -> per-sample values (any sequence of length ``B``).
        meta: batch-level values (not per sample).
        batch_size: required only when the batch has no tensors and no non-tensor columns.
    """

    __slots__ = ("tensors", "non_tensors", "meta")

    def __init__(
        self,
        tensors: TensorDict | Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        batch_size: int | None = None,
    ) -> None:
        tensors = dict(tensors.items()) if tensors is not None else {}
        non_tensors = dict(non_tensors) if non_tensors is not None else {}
        sizes = {name: t.shape[0] for name, t in tensors.items() if t.ndim > 0}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"tensor field {name!r} must be a torch.Tensor, got {type(t).__name__}")
            if t.ndim == 0:
                raise ValueError(f"tensor field {name!r} is 0-D; per-sample tensors need a batch dimension")
        sizes.update({name: len(v) for name, v in non_tensors.items()})
        if batch_size is None:
            if not sizes:
                raise ValueError("an empty Batch needs an explicit batch_size")
            batch_size = next(iter(sizes.values()))
        mismatched = {name: n for name, n in sizes.items() if n != batch_size}
        if mismatched:
            raise ValueError(f"batch size mismatch: expected {batch_size} samples, but {mismatched}")
        for name, t in tensors.items():
            check_standard_field(name, t)
        self.tensors = TensorDict(tensors, batch_size=[batch_size])
        self.non_tensors = {name: _object_column(name, v, batch_size) for name, v in non_tensors.items()}
        self.meta = dict(meta) if meta is not None else {}

    # ------------------------------------------------------------------ access
    @property
    def batch_size(self) -> int:
        return int(self.tensors.batch_size[0])

    def __len__(self) -> int:
        return self.batch_size

    def keys(self) -> list[str]:
        """Names of all per-sample fields, tensors first."""
        return list(self.tensors.keys()) + list(self.non_tensors.keys())

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def _missing(self, key: str) -> KeyError:
        return KeyError(f"field {key!r} is not in this batch; it has {sorted(self.keys())}")

    def __getitem__(self, key: str | Index) -> Any:
        """``batch["name"]`` gives a field; ``batch[i]`` one sample as a dict; slices/indices a Batch."""
        if isinstance(key, str):
            if key in self.tensors.keys():
                return self.tensors[key]
            if key in self.non_tensors:
                return self.non_tensors[key]
            raise self._missing(key)
        if isinstance(key, (int, np.integer)):
            return self.sample(int(key))
        return self._take(key)

    def get(self, key: str, default: Any = None) -> Any:
        """The field ``key`` (tensor or per-sample column), or ``default`` when absent."""
        return self[key] if key in self else default  # noqa: SIM401 (this *is* get)

    def sample(self, i: int) -> dict[str, Any]:
        """Sample ``i`` as a dict of field name -> value (tensors lose the batch dimension)."""
        if not -self.batch_size <= i < self.batch_size:
            raise IndexError(f"sample index {i} out of range for batch size {self.batch_size}")
        row = {name: t[i] for name, t in self.tensors.items()}
        row.update({name: col[i] for name, col in self.non_tensors.items()})
        return row

    def iter_samples(self) -> Iterator[dict[str, Any]]:
        """Iterate over samples, each a dict as returned by :meth:`sample`."""
        for i in range(self.batch_size):
            yield self.sample(i)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.iter_samples()

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}: {tuple(t.shape)} {t.dtype}" for k, t in self.tensors.items())
        objs = ", ".join(self.non_tensors)
        return f"Batch(size={self.batch_size}, tensors=[{fields}], non_tensors=[{objs}], meta={sorted(self.meta)})"

    # ------------------------------------------------------------------ building
    def _replace(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        batch_size: int | None = None,
    ) -> Batch:
        out = object.__new__(Batch)
        size = self.batch_size if batch_size is None else batch_size
        out.tensors = TensorDict(dict(tensors.items()) if tensors is not None else {}, batch_size=[size])
        out.non_tensors = dict(non_tensors) if non_tensors is not None else {}
        out.meta = dict(self.meta if meta is None else meta)
        return out

    def assign(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Batch:
        """A new batch with the given fields added or replaced (checked like the constructor)."""
        return Batch(
            tensors={**dict(self.tensors.items()), **dict(tensors or {})},
            non_tensors={**self.non_tensors, **dict(non_tensors or {})},
            meta={**self.meta, **dict(meta or {})},
            batch_size=self.batch_size,
        )

    def select(self, keys: Iterable[str], meta_keys: Iterable[str] | None = None) -> Batch:
        """A batch with only ``keys`` (tensor or non-tensor) and, if given, only ``meta_keys``."""
        keys = list(keys)
        for key in keys:
            if key not in self:
                raise self._missing(key)
        meta = self.meta
        if meta_keys is not None:
            meta_keys = list(meta_keys)
            unknown = [k for k in meta_keys if k not in self.meta]
            if unknown:
                raise KeyError(f"meta keys {unknown} are not in this batch; it has {sorted(self.meta)}")
            meta = {k: self.meta[k] for k in meta_keys}
        return self._replace(
            tensors={k: self.tensors[k] for k in keys if k in self.tensors.keys()},
            non_tensors={k: self.non_tensors[k] for k in keys if k in self.non_tensors},
            meta=meta,
        )

    def pop(self, keys: Iterable[str]) -> tuple[Batch, Batch]:
        """Split off ``keys``: returns ``(batch with keys, batch with the rest)``; the input is unchanged."""
        keys = list(keys)
        taken = self.select(keys)
        rest = [k for k in self.keys() if k not in set(keys)]
        return taken, self.select(rest)

    def union(self, other: Batch) -> Batch:
        """Merge the fields of two batches of equal size; a key present in both must hold equal values."""
        if other.batch_size != self.batch_size:
            raise ValueError(f"cannot union batches of sizes {self.batch_size} and {other.batch_size}")
        tensors = dict(self.tensors.items())
        for key, value in other.tensors.items():
            if key in tensors and not (
                tensors[key].shape == value.shape
                and tensors[key].dtype == value.dtype
                and torch.equal(tensors[key], value)
            ):
                raise ValueError(f"union conflict: tensor field {key!r} differs between the two batches")
            tensors[key] = value
        non_tensors = dict(self.non_tensors)
        for key, value in other.non_tensors.items():
            if key in non_tensors and not _objects_equal(non_tensors[key], value):
                raise ValueError(f"union conflict: non-tensor field {key!r} differs between the two batches")
            non_tensors[key] = value
        meta = dict(self.meta)
        for key, value in other.meta.items():
            if key in meta and not _objects_equal(meta[key], value):
                raise ValueError(f"union conflict: meta key {key!r} differs: {meta[key]!r} vs {value!r}")
            meta[key] = value
        return self._replace(tensors, non_tensors, meta)

    # ------------------------------------------------------------------ reshaping
    def _take(self, index: Index) -> Batch:
        if isinstance(index, slice):
            tensors = {k: t[index] for k, t in self.tensors.items()}
            non_tensors = {k: col[index] for k, col in self.non_tensors.items()}
            size = len(range(*index.indices(self.batch_size)))
        else:
            index = torch.as_tensor(np.asarray(index) if not isinstance(index, torch.Tensor) else index)
            if index.dtype == torch.bool:
                if index.shape != (self.batch_size,):
                    raise ValueError(
                        f"boolean index has shape {tuple(index.shape)}, expected ({self.batch_size},)"
                    )
                index = index.nonzero().flatten()
            if index.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
                raise ValueError(f"index must hold integers or booleans, got {index.dtype}")
            index = index.long().flatten()
            if index.numel() and (index.max() >= self.batch_size or index.min() < -self.batch_size):
                raise IndexError(f"index out of range for batch size {self.batch_size}")
            tensors = {
                k: t.index_select(0, index.to(t.device) % self.batch_size) for k, t in self.tensors.items()
            }
            np_index = _to_numpy_index(index)
            non_tensors = {k: col[np_index] for k, col in self.non_tensors.items()}
            size = int(index.numel())
        return self._replace(tensors, non_tensors, batch_size=size)

    def reorder(self, index: torch.Tensor | Sequence[int]) -> Batch:
        """Samples in the order given by ``index`` (e.g. a permutation from a balancing step)."""
        return self._take(index)

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Stack batches along the batch dimension; all must have the same fields and agree on meta."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            if set(b.keys()) != set(first.keys()):
                raise ValueError(
                    f"concat: batch {i} has fields {sorted(b.keys())}, batch 0 has {sorted(first.keys())}"
                )
        meta: dict[str, Any] = {}
        for b in batches:
            for key, value in b.meta.items():
                if key in meta and not _objects_equal(meta[key], value):
                    raise ValueError(
                        f"concat: meta key {key!r} differs between batches: {meta[key]!r} vs {value!r}"
                    )
                meta[key] = value
        tensors = {}
        for key in first.tensors.keys():
            parts = [b.tensors[key] for b in batches]
            trailing = {tuple(p.shape[1:]) for p in parts}
            if len(trailing) > 1:
                raise ValueError(
                    f"concat: tensor field {key!r} has different trailing shapes {sorted(trailing)}"
                )
            tensors[key] = torch.cat(parts, dim=0)
        non_tensors = {
            key: np.concatenate([b.non_tensors[key] for b in batches]) for key in first.non_tensors
        }
        return first._replace(tensors, non_tensors, meta, batch_size=sum(b.batch_size for b in batches))

    def repeat(self, times: int, interleave: bool = True) -> Batch:
        """Repeat samples ``times`` times: interleaved ``[a a b b]`` (n responses per prompt) or tiled ``[a b a b]``."""
        if times <= 0:
            raise ValueError(f"repeat times must be positive, got {times}")
        base = torch.arange(self.batch_size)
        index = base.repeat_interleave(times) if interleave else base.repeat(times)
        return self._take(index)

    def pad_to_divisor(self, divisor: int) -> tuple[Batch, int]:
        """Pad by repeating leading samples until the size divides ``divisor``; returns ``(batch, pad_size)``.

        Real samples (not zeros) are used as padding so that no worker sees an all-masked
        row; :meth:`unpad` with the returned ``pad_size`` removes them again.
        """
        if divisor <= 0:
            raise ValueError(f"divisor must be positive, got {divisor}")
        if self.batch_size == 0:
            raise ValueError("cannot pad an empty batch: there is no sample to repeat")
        pad_size = (-self.batch_size) % divisor
        if pad_size == 0:
            return self, 0
        index = torch.cat([torch.arange(self.batch_size), torch.arange(pad_size) % self.batch_size])
        return self._take(index), pad_size

    def unpad(self, pad_size: int) -> Batch:
        """Remove ``pad_size`` trailing samples added by :meth:`pad_to_divisor`."""
        if not 0 <= pad_size <= self.batch_size:
            raise ValueError(f"pad_size {pad_size} is outside [0, {self.batch_size}]")
        return self if pad_size == 0 else self[: self.batch_size - pad_size]

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor on ``device``."""
        return self._replace({k: to_device(t, device) for k, t in self.tensors.items()}, self.non_tensors)

    # ------------------------------------------------------------------ comparison
    def equals(self, other: Batch) -> bool:
        """Exact equality of fields (values, dtypes, shapes), non-tensor columns and meta."""
        if self.batch_size != other.batch_size or set(self.keys()) != set(other.keys()):
            return False
        for key, t in self.tensors.items():
            o = other.tensors[key]
            if t.dtype != o.dtype or t.shape != o.shape or not torch.equal(t, o.to(t.device)):
                return False
        same_objects = all(_objects_equal(col, other.non_tensors[k]) for k, col in self.non_tensors.items())
        return same_objects and _objects_equal(self.meta, other.meta)


def _objects_equal(a: Any, b: Any) -> bool:
    """Equality for Python objects and object arrays, elementwise and exact."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a_list, b_list = list(a), list(b)
        return len(a_list) == len(b_list) and all(
            _objects_equal(x, y) for x, y in zip(a_list, b_list, strict=True)
        )
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_objects_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_objects_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def group_ids_from_uids(uids: Sequence[Any]) -> torch.Tensor:
    """Map group uids (e.g. the ``uid`` column) to contiguous int64 ids in first-seen order.

    Returns:
        ``[B]`` int64 tensor; samples with the same uid get the same id.
    """
    mapping: dict[Any, int] = {}
    return torch.tensor([mapping.setdefault(u, len(mapping)) for u in uids], dtype=torch.int64)
