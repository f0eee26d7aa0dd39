"""``BatchRef``: a batch as the controller holds it — where each row's per-token fields live,
plus the small per-row scalars inline.

A ``BatchRef`` of ``B`` rows has

* ``scalars``: an ordinary small :class:`~tandem.protocol.Batch` of ``B`` rows with the fields
  held inline (uid, group id, score, lengths: 1-D tensors and Python columns) and the meta;
* ``parts``: for each set of fields stored together, the blocks holding them and, per row, which
  block (``block_of_row [B]``) and which row in it (``row_in_block [B]``), and the name each
  field is stored under (a field exposed under a second name, :meth:`BatchRef.alias`);
* ``schema``: each stored field's dtype and row shape.

Row operations (index, select, chunk, split, concat, reorder, repeat, pad/unpad, union, and
the field operations crop and alias) are
those of :class:`Batch`, done by rewriting the index arrays: no payload is touched.
:meth:`BatchRef.materialise` fetches the asked fields of these rows — each block's rows once —
and builds the padded ``Batch`` the same operation on the materialised batch would give.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tandem.dataplane.store import Block, Store
from tandem.protocol import Batch
from tandem.protocol.batch import RowPieces

Getter = Callable[[Block, Sequence[str], Sequence[int]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class FieldSchema:
    """A stored field as it materialises: dtype (torch name), one row's shape and, when only a
    window of the stored rows is wanted, ``crop = (axis, start, stop)`` along ``axis`` of a row
    (the cut of padding columns: :meth:`BatchRef.crop`)."""

    dtype: str
    shape: tuple[int, ...]
    crop: tuple[int, int, int] | None = None

    def cropped(self, axis: int, start: int, stop: int) -> FieldSchema:
        """This field with only ``[start, stop)`` of ``axis`` of what it materialises now."""
        if not 0 <= axis < len(self.shape) or not 0 <= start < stop <= self.shape[axis]:
            raise ValueError(f"crop ({axis}, {start}, {stop}) is outside a row of shape {self.shape}")
        if self.crop is not None and self.crop[0] != axis:
            raise ValueError(f"a field cropped along axis {self.crop[0]} cannot be cropped along {axis}")
        offset = 0 if self.crop is None else self.crop[1]
        shape = (*self.shape[:axis], stop - start, *self.shape[axis + 1 :])
        return FieldSchema(self.dtype, shape, (axis, offset + start, offset + stop))

    def apply(self, fetched: torch.Tensor) -> torch.Tensor:
        """``fetched [n, *stored row]`` cut to this field's window (itself when uncropped)."""
        if self.crop is None:
            return fetched
        axis, start, stop = self.crop
        return fetched.narrow(axis + 1, start, stop - start).contiguous()


@dataclass(frozen=True, eq=False)
class RefPart:
    """Fields stored together: ``blocks``, and per row ``block_of_row [B]``/``row_in_block [B]``.

    ``stored_as`` names, for each of ``fields``, the field its blocks hold it under (empty: the
    same names). A field exposed under a second name (:meth:`BatchRef.alias`) is the stored one
    read again: a fetch asks the blocks for each stored name once."""

    fields: tuple[str, ...]
    blocks: tuple[Block, ...]
    block_of_row: np.ndarray
    row_in_block: np.ndarray
    stored_as: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.stored_as and len(self.stored_as) != len(self.fields):
            raise ValueError(f"a part of fields {self.fields} names {len(self.stored_as)} stored fields")
        if self.stored_as == self.fields:
            object.__setattr__(self, "stored_as", ())

    def stored_name(self, name: str) -> str:
        """The field the blocks hold ``name`` under (itself unless it is an alias)."""
        return self.stored_as[self.fields.index(name)] if self.stored_as else name

    def stored_names(self, names: Iterable[str]) -> list[str]:
        """The distinct stored fields a fetch of ``names`` (fields of this part) asks the blocks for."""
        return list(dict.fromkeys(self.stored_name(n) for n in names))

    def take(self, positions: np.ndarray) -> RefPart:
        rows = self.block_of_row[positions], self.row_in_block[positions]
        return RefPart(self.fields, self.blocks, *rows, self.stored_as)

    def narrow(self, fields: Iterable[str]) -> RefPart:
        keep = set(fields)
        kept = [(f, self.stored_name(f)) for f in self.fields if f in keep]
        return RefPart(
            tuple(f for f, _ in kept), self.blocks, self.block_of_row, self.row_in_block,
            tuple(s for _, s in kept),
        )  # fmt: skip

    def aliased(self, names: dict[str, str]) -> RefPart:
        """This part with its fields ``names.values()`` also exposed as ``names.keys()``."""
        new = tuple(n for n, source in names.items() if source in self.fields)
        stored = tuple(self.stored_name(names[n]) for n in new)
        return RefPart(
            (*self.fields, *new), self.blocks, self.block_of_row, self.row_in_block,
            (*(self.stored_name(f) for f in self.fields), *stored),
        )  # fmt: skip

    @property
    def layout(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """What two parts must share to be joined row-wise: their fields and stored names."""
        return self.fields, self.stored_as


def _positions(size: int, index: Any) -> np.ndarray:
    """The row positions ``Batch[index]`` selects from ``size`` rows (its exact rules)."""
    return Batch({"position": torch.arange(size)})[index]["position"].numpy()


class BatchRef(RowPieces):
    """See the module docstring. Build one with :meth:`put`; every op returns a new ``BatchRef``."""

    __slots__ = ("parts", "scalars", "schema")

    def __init__(self, scalars: Batch, parts: Sequence[RefPart], schema: dict[str, FieldSchema]) -> None:
        for part in parts:
            if len(part.block_of_row) != len(scalars) or len(part.row_in_block) != len(scalars):
                raise ValueError(
                    f"a part of fields {part.fields} has rows unlike the scalars' {len(scalars)}"
                )
        stored = [f for part in parts for f in part.fields]
        if len(set(stored)) != len(stored) or set(stored) & set(scalars.keys()):
            raise ValueError(f"a field is held twice: stored {stored}, inline {scalars.keys()}")
        self.scalars = scalars
        self.parts = tuple(part for part in parts if part.fields)
        self.schema = {f: schema[f] for part in self.parts for f in part.fields}

    # ------------------------------------------------------------------ building
    @staticmethod
    def put(
        batch: Batch,
        store: Store,
        fields: Iterable[str] | None = None,
        also: Mapping[str, Any] | None = None,
    ) -> BatchRef:
        """Store ``fields`` of ``batch`` (default: every tensor field of rank >= 2), and the fields
        ``also`` gives beside the batch (``[N, ...]`` each, e.g. :class:`~tandem.dataplane.columns.UnpaddedField`
        never built padded), as one block in ``store``; the other fields and the meta stay inline."""
        if fields is None:
            fields = [name for name, t in batch.tensors.items() if t.ndim >= 2]
        fields = list(fields)
        for name in fields:
            if name not in batch.tensors.keys():
                raise KeyError(f"BatchRef.put: {name!r} is not a tensor field of the batch ({batch.keys()})")
        also = dict(also or {})
        for name, given in also.items():
            if name in batch.keys() or given.shape[0] != len(batch):
                raise ValueError(
                    f"BatchRef.put: the field {name!r} given beside the batch is {tuple(given.shape)} "
                    f"for a batch of {len(batch)} rows{' that holds it too' if name in batch.keys() else ''}"
                )
        inline = [k for k in batch.keys() if k not in set(fields)]
        scalars = batch.select(inline)
        if not fields and not also:
            return BatchRef(scalars, (), {})
        block = store.put({**{name: batch.tensors[name] for name in fields}, **also})
        fields += list(also)
        rows = len(batch)
        part = RefPart(tuple(fields), (block,), np.zeros(rows, np.int32), np.arange(rows, dtype=np.int64))
        schema = {c.name: FieldSchema(c.dtype, c.shape) for c in block.columns}
        return BatchRef(scalars, (part,), schema)

    # ------------------------------------------------------------------ access
    @property
    def batch_size(self) -> int:
        return len(self.scalars)

    def __len__(self) -> int:
        return self.batch_size

    @property
    def meta(self) -> dict[str, Any]:
        return self.scalars.meta

    def stored_fields(self) -> list[str]:
        return [f for part in self.parts for f in part.fields]

    def keys(self) -> list[str]:
        """Every field: stored ones first, then the inline scalars."""
        return self.stored_fields() + self.scalars.keys()

    def __contains__(self, key: str) -> bool:
        return key in self.schema or key in self.scalars

    def blocks(self) -> list[Block]:
        """The distinct blocks these rows' fields live in."""
        seen: dict[int, Block] = {}
        for part in self.parts:
            for i in np.unique(part.block_of_row):
                seen.setdefault(id(part.blocks[i]), part.blocks[i])
        return list(seen.values())

    def __getitem__(self, key: str | Any) -> Any:
        """``ref["uid"]``: an inline field; a slice, index array or mask: a ``BatchRef`` of those rows."""
        if isinstance(key, str):
            if key in self.schema:
                raise KeyError(f"{key!r} is stored, not inline; materialise([{key!r}]) fetches it")
            return self.scalars[key]
        if isinstance(key, (int, np.integer)):
            raise TypeError("a BatchRef has no single-row view; index with a slice or an index array")
        return self._take(_positions(self.batch_size, key))

    def __repr__(self) -> str:
        return (
            f"BatchRef(size={self.batch_size}, stored={self.stored_fields()}, inline={self.scalars.keys()})"
        )

    # ------------------------------------------------------------------ row ops (indices only)
    def _take(self, positions: np.ndarray) -> BatchRef:
        scalars = self.scalars[torch.from_numpy(np.ascontiguousarray(positions))]
        return BatchRef(scalars, [p.take(positions) for p in self.parts], self.schema)

    def select(self, keys: Iterable[str]) -> BatchRef:
        """Only ``keys`` (stored or inline), like :meth:`Batch.select`."""
        keys = list(keys)
        unknown = [k for k in keys if k not in self]
        if unknown:
            raise KeyError(f"fields {unknown} are not in this batch; it has {sorted(self.keys())}")
        scalars = self.scalars.select([k for k in keys if k in self.scalars])
        return BatchRef(scalars, [p.narrow(keys) for p in self.parts], self.schema)

    def union(self, other: BatchRef) -> BatchRef:
        """The fields of both (rows in the same order); a stored field may come from one side only."""
        if len(other) != len(self):
            raise ValueError(f"cannot union batches of sizes {len(self)} and {len(other)}")
        both = set(self.schema) & set(other.schema)
        if both:
            raise ValueError(f"union: stored fields {sorted(both)} are on both sides")
        return BatchRef(
            self.scalars.union(other.scalars), [*self.parts, *other.parts], {**self.schema, **other.schema}
        )

    def crop(self, windows: dict[str, tuple[int, int, int]]) -> BatchRef:
        """Stored fields cut to windows ``{field: (axis, start, stop)}`` of their rows (the
        padding columns a ``Batch`` would trim); the blocks are untouched, ranks fetch the rows
        and keep the window."""
        schema = dict(self.schema)
        for name, (axis, start, stop) in windows.items():
            if name not in schema:
                raise KeyError(f"crop: {name!r} is not a stored field; stored: {self.stored_fields()}")
            schema[name] = schema[name].cropped(axis, start, stop)
        return BatchRef(self.scalars, self.parts, schema)

    def alias(self, names: dict[str, str]) -> BatchRef:
        """Stored fields exposed under second names too, ``{new name: stored field}`` (the rename of
        ``Batch.assign(tensors={new: batch[field]})``), by metadata only: a fetch of either name
        asks the blocks for the field once and returns it under each name asked, with its crop.
        The blocks are the same ones, so :meth:`blocks` (and a release) counts each once."""
        for name, source in names.items():
            if name in self:
                raise ValueError(f"alias: {name!r} is already a field of this batch ({self.keys()})")
            if source not in self.schema:
                raise KeyError(f"alias: {source!r} is not a stored field; stored: {self.stored_fields()}")
        schema = {**self.schema, **{name: self.schema[source] for name, source in names.items()}}
        return BatchRef(self.scalars, [p.aliased(names) for p in self.parts], schema)

    def reorder(self, index: torch.Tensor | Sequence[int]) -> BatchRef:
        return self[index]

    def repeat(self, times: int, interleave: bool = True) -> BatchRef:
        if times <= 0:
            raise ValueError(f"repeat times must be positive, got {times}")
        base = np.arange(self.batch_size)
        return self._take(np.repeat(base, times) if interleave else np.tile(base, times))

    def pad_to_divisor(self, divisor: int) -> tuple[BatchRef, int]:
        """Repeat leading rows until the size divides ``divisor`` (as :meth:`Batch.pad_to_divisor`)."""
        if divisor <= 0:
            raise ValueError(f"divisor must be positive, got {divisor}")
        if self.batch_size == 0:
            raise ValueError("cannot pad an empty batch: there is no sample to repeat")
        pad = (-self.batch_size) % divisor
        if pad == 0:
            return self, 0
        return self._take(np.concatenate([np.arange(self.batch_size), np.arange(pad) % self.batch_size])), pad

    def unpad(self, pad_size: int) -> BatchRef:
        if not 0 <= pad_size <= self.batch_size:
            raise ValueError(f"pad_size {pad_size} is outside [0, {self.batch_size}]")
        return self if pad_size == 0 else self[: self.batch_size - pad_size]

    @staticmethod
    def concat(refs: Sequence[BatchRef]) -> BatchRef:
        """Rows of every ref in order; all must hold the same fields, stored the same way."""
        if not refs:
            raise ValueError("concat needs at least one batch")
        first = refs[0]
        layout = [p.layout for p in first.parts]
        for i, ref in enumerate(refs[1:], start=1):
            if [p.layout for p in ref.parts] != layout or ref.schema != first.schema:
                raise ValueError(
                    f"concat: batch {i} stores {[p.layout for p in ref.parts]}, batch 0 {layout} "
                    "(fields, and the stored names of aliases; or their dtypes/shapes differ)"
                )
        parts = []
        for k, (fields, stored_as) in enumerate(layout):
            blocks: list[Block] = []
            block_of_row, row_in_block = [], []
            for ref in refs:
                part = ref.parts[k]
                block_of_row.append(part.block_of_row + len(blocks))
                row_in_block.append(part.row_in_block)
                blocks.extend(part.blocks)
            parts.append(
                RefPart(
                    fields,
                    tuple(blocks),
                    np.concatenate(block_of_row).astype(np.int32),
                    np.concatenate(row_in_block),
                    stored_as,
                )
            )
        return BatchRef(Batch.concat([r.scalars for r in refs]), parts, first.schema)

    # ------------------------------------------------------------------ payload
    def materialise(self, get: Getter, fields: Iterable[str] | None = None) -> Batch:
        """The padded ``Batch`` of ``fields`` (default: all) of these rows, fetched with ``get``
        (``store.get``): each block is asked once, for the distinct rows it holds."""
        wanted = self.keys() if fields is None else list(fields)
        unknown = [f for f in wanted if f not in self]
        if unknown:
            raise KeyError(f"fields {unknown} are not in this batch; it has {sorted(self.keys())}")
        tensors: dict[str, torch.Tensor] = {}
        for part in self.parts:
            names = [f for f in part.fields if f in set(wanted)]
            if names:
                tensors.update(self._fetch(part, names, get))
        inline = self.scalars.select([f for f in wanted if f in self.scalars])
        return inline.assign(tensors=tensors)

    def _fetch(self, part: RefPart, names: list[str], get: Getter) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for b in np.unique(part.block_of_row):
            at = np.flatnonzero(part.block_of_row == b)
            rows, inverse = np.unique(part.row_in_block[at], return_inverse=True)
            stored = get(part.blocks[b], part.stored_names(names), rows)
            fetched = {n: self.schema[n].apply(stored[part.stored_name(n)]) for n in names}
            whole = len(at) == self.batch_size and np.array_equal(inverse, np.arange(len(at)))
            for name in names:
                if whole:
                    out[name] = fetched[name]
                    continue
                if name not in out:
                    schema = self.schema[name]
                    out[name] = torch.empty(
                        (self.batch_size, *schema.shape), dtype=getattr(torch, schema.dtype)
                    )
                out[name][torch.from_numpy(at)] = fetched[name][torch.from_numpy(inverse.reshape(-1))]
        return out

    def release(self, release: Callable[[Block], None]) -> None:
        """Release every block these rows live in with ``release`` (``store.release``)."""
        for block in self.blocks():
            release(block)

    # ------------------------------------------------------------------ pickling
    def __reduce__(self) -> tuple:
        """Pickle the inline scalars as plain tensors and arrays (not as a ``Batch``, whose bytes
        the controller's payload counters count) and the parts' index arrays."""
        s = self.scalars
        return (_rebuild, (dict(s.tensors.items()), s.non_tensors, s.meta, len(s), self.parts, self.schema))


def _rebuild(tensors: dict, non_tensors: dict, meta: dict, size: int, parts: tuple, schema: dict) -> BatchRef:
    return BatchRef(Batch(tensors, non_tensors, meta, batch_size=size), parts, schema)
