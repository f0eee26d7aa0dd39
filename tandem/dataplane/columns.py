"""The wire form of a batch's per-token fields: narrow, jagged columns, and back to padded tensors.

A padded field ``[N, W, *trailing]`` is stored *jagged*: for each row only the window
``[start, start + length)`` of dim 1 that holds every element differing from the field's fill
value (the pad id of token ids, 0 of masks), as

* ``values  [T, *trailing]`` — the rows' windows one after the other (``T = sum(length)``),
* ``offsets [N + 1] int64``  — row ``i``'s values are ``values[offsets[i]:offsets[i + 1]]``,
* ``starts  [N] int32``      — where row ``i``'s window begins in the padded row.

Decoding writes each window back into a row of fill values, so the round trip is bit-exact
whatever the field holds (a pad-valued token inside a window is kept; one outside is the fill).
Integer values travel in the narrowest of ``uint8``/``int16``/``int32``/``int64`` that holds
them (token ids int32, versions int32 or less, masks uint8); floats keep their dtype (log-probs
fp32, ``bfloat16`` as its bits). A field of rank 1 is *dense*: ``values [N, *trailing]``.

Two cases store less:

* a jagged field whose windows hold one value only (a mask of ones: ``attention_mask``, a
  single-turn ``response_mask``) stores no ``values``, only that value's bits (``constant_bits``)
  with its offsets and starts: 8 bytes a row;
* a field equal to its derivation from others of the same block (``input_ids`` from ``prompts``
  and ``responses``, ``position_ids`` from ``attention_mask``: :mod:`tandem.dataplane.derived`)
  stores nothing; its ``sources`` are read instead and it is built on the reader.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.dataplane.derived import DERIVATIONS, build, build_of_windows, derivable
from tandem.dataplane.windows import (
    as_bits,
    empty_tensors,
    padded_from_windows,
    rows_of_dense,
    windows_of_padded,
)

_NARROW = (np.uint8, np.int16, np.int32, np.int64)


@dataclass(frozen=True)
class WireColumn:
    """One field's layout in a block.

    Attributes:
        name: the field.
        dtype: the materialised tensor's dtype (torch name, e.g. ``int64``).
        shape: a materialised row's shape (``(W, *trailing)``, or ``trailing`` when dense).
        wire: the stored values' dtype (torch name).
        jagged: stored as values/offsets/starts (rank >= 2) or dense (rank 1).
        fill_bits: the fill value's bits (as the integer of the dtype's width), outside windows.
        constant_bits: a jagged field whose windows hold this one value's bits only: no values
            stored (``None``: values stored).
        sources: a derived field's sources in the block (nothing of it stored); ``()``: stored.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    wire: str
    jagged: bool
    fill_bits: int = 0
    constant_bits: int | None = None
    sources: tuple[str, ...] = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def wire_dtype(self) -> torch.dtype:
        return getattr(torch, self.wire)

    def arrays(self) -> tuple[str, ...]:
        """The names of the stored arrays of this field (none for a derived one)."""
        if self.sources:
            return ()
        if not self.jagged:
            return (f"{self.name}.values",)
        index = (f"{self.name}.offsets", f"{self.name}.starts")
        return index if self.constant_bits is not None else (f"{self.name}.values", *index)


def _narrowest(values: np.ndarray) -> np.dtype:
    """The narrowest wire integer (``uint8``/``int16``/``int32``/``int64``) holding every value of
    integer ``values``; their own dtype when none does (``uint64`` beyond ``int64``)."""
    if values.size == 0:
        return np.dtype(np.uint8)
    low, high = int(values.min()), int(values.max())
    for dtype in _NARROW:
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return np.dtype(dtype)
    return values.dtype


def _as_source(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of ``tensor``: an integer tensor's values, otherwise its bits (floats keep their
    bits on the wire; a bool's bits are the uint8 0/1 the wire holds)."""
    integer = not (tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool)
    return tensor.numpy() if integer else as_bits(tensor)


def _wire_values(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Values gathered from :func:`_as_source` as the wire holds them: integers narrowed, floats
    (from their bits) in their own dtype."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.from_numpy(values).view(dtype)
    return torch.from_numpy(values.astype(_narrowest(values), copy=False))


def _fill_bits(bits: np.ndarray) -> int:
    """The most common first element of the rows' first and last positions (the pad)."""
    rows = len(bits)
    edges = np.concatenate([bits[:, 0].reshape(rows, -1)[:, 0], bits[:, -1].reshape(rows, -1)[:, 0]])
    values, counts = np.unique(edges, return_counts=True)
    return int(values[counts.argmax()])


def encode_field(name: str, tensor: torch.Tensor) -> tuple[WireColumn, dict[str, torch.Tensor]]:
    """The wire column of ``tensor [N, ...]`` and its arrays (see the module docstring).

    Numpy, one pass per step on the calling thread (see :mod:`tandem.dataplane.windows`): find
    each row's window on the bits, gather the windows, narrow the gathered integers."""
    tensor = tensor.detach().cpu().contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.ndim < 2 or tensor.numel() == 0:
        values = _wire_values(_as_source(tensor), tensor.dtype)
        column = WireColumn(
            name, dtype, tuple(tensor.shape[1:]), str(values.dtype).removeprefix("torch."), False
        )
        return column, {f"{name}.values": values}
    bits = as_bits(tensor)
    fill = _fill_bits(bits)
    first, offsets = _windows(bits, fill)
    gathered = windows_of_padded(_as_source(tensor), first, offsets)
    if fill == 1 and not _one_value(gathered):  # a mask whose edges are mostly ones: try zeros as fill
        first_zero, offsets_zero = _windows(bits, 0)
        gathered_zero = windows_of_padded(_as_source(tensor), first_zero, offsets_zero)
        if _one_value(gathered_zero):
            fill, first, offsets, gathered = 0, first_zero, offsets_zero, gathered_zero
    return _jagged(name, tensor.dtype, tuple(tensor.shape[1:]), fill, first, offsets, gathered)


def _jagged(
    name: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    fill: int,
    first: np.ndarray,
    offsets: np.ndarray,
    gathered: np.ndarray,
) -> tuple[WireColumn, dict[str, torch.Tensor]]:
    """The jagged wire column of a field of ``dtype`` and row ``shape`` whose rows' windows begin at
    ``first [N]``, lie at ``offsets [N + 1]`` of ``gathered [T, *trailing]`` (:func:`_as_source`'s
    values) and are padded with ``fill``'s bits; and its arrays."""
    arrays = {
        f"{name}.offsets": torch.from_numpy(offsets),
        f"{name}.starts": torch.from_numpy(first.astype(np.int32)),
    }
    name_of = str(dtype).removeprefix("torch.")
    if _one_value(gathered):  # windows of one value (a mask of ones): no values stored
        bits_dtype = as_bits(torch.empty(0, dtype=dtype)).dtype  # the element's width, as an integer
        constant = int(gathered.reshape(-1)[:1].view(bits_dtype)[0])
        return WireColumn(name, name_of, shape, name_of, True, fill, constant), arrays
    values = _wire_values(gathered, dtype)
    column = WireColumn(name, name_of, shape, str(values.dtype).removeprefix("torch."), True, fill)
    return column, {f"{name}.values": values, **arrays}


@dataclass(frozen=True)
class UnpaddedField:
    """A field ``[N, width, *trailing]`` given as each row's values and where they sit, never built
    padded: row ``i`` holds ``pieces[i] [L_i, *trailing]`` (``None``: nothing) from column
    ``at[i]`` on, zeros everywhere else. Every piece lies within columns ``1 .. width - 2``, so the
    padded field's edges are zeros and its fill is zero; :func:`encode` then stores it exactly as it
    would store :meth:`padded` (``tests/dataplane/test_unpadded_field.py``) while holding only the
    pieces. A vision-language draw's pixels are one (:func:`tandem.dataplane.images.image_columns`):
    padded to the prompt width's bound they would take ``rows x bound x patch`` floats to build."""

    pieces: tuple[torch.Tensor | None, ...]
    at: tuple[int, ...]
    width: int
    trailing: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if len(self.pieces) != len(self.at):
            raise ValueError(f"UnpaddedField: {len(self.pieces)} pieces but {len(self.at)} places")
        for row, (piece, at) in enumerate(zip(self.pieces, self.at, strict=True)):
            if piece is None:
                continue
            if piece.dtype != self.dtype or tuple(piece.shape[1:]) != self.trailing:
                raise ValueError(
                    f"UnpaddedField: row {row}'s piece is {piece.dtype} {tuple(piece.shape)}, not "
                    f"{self.dtype} [L, {', '.join(map(str, self.trailing))}]"
                )
            if at < 1 or at + len(piece) > self.width - 1:
                raise ValueError(
                    f"UnpaddedField: row {row}'s {len(piece)} values at column {at} leave the columns "
                    f"1..{self.width - 2} of its {self.width}"
                )

    @property
    def shape(self) -> tuple[int, ...]:
        """The padded field's shape, ``(N, width, *trailing)``."""
        return (len(self.pieces), self.width, *self.trailing)

    def padded(self) -> torch.Tensor:
        """The field as a padded tensor (what the pieces stand for; a reference, for tests)."""
        out = torch.zeros(self.shape, dtype=self.dtype)
        for row, (piece, at) in enumerate(zip(self.pieces, self.at, strict=True)):
            if piece is not None:
                out[row, at : at + len(piece)] = piece
        return out


def encode_unpadded(name: str, field: UnpaddedField) -> tuple[WireColumn, dict[str, torch.Tensor]]:
    """:func:`encode_field` of ``field.padded()``, bit for bit, from the pieces alone: each row's
    window (its first to last value unlike zero) found in its own piece, the windows gathered."""
    if not field.pieces or 0 in field.trailing:
        return encode_field(name, field.padded())
    first = np.zeros(len(field.pieces), dtype=np.int64)
    lengths = np.zeros(len(field.pieces), dtype=np.int64)
    chunks = []
    for row, (piece, at) in enumerate(zip(field.pieces, field.at, strict=True)):
        if piece is None or len(piece) == 0:
            continue
        piece = piece.detach().cpu().contiguous()
        differs = (as_bits(piece).reshape(len(piece), -1) != 0).any(axis=1)
        if not differs.any():
            continue
        low, high = int(differs.argmax()), len(piece) - int(differs[::-1].argmax())
        first[row], lengths[row] = at + low, high - low
        chunks.append(_as_source(piece)[low:high])
    offsets = np.zeros(len(field.pieces) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    source = _as_source(torch.empty((0, *field.trailing), dtype=field.dtype))
    gathered = np.concatenate(chunks) if chunks else source
    return _jagged(name, field.dtype, (field.width, *field.trailing), 0, first, offsets, gathered)


def _windows(bits: np.ndarray, fill: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's window of ``bits [N, W, ...]`` holding every element unlike ``fill``: its first
    column ``[N]`` and the windows' ``offsets [N + 1]`` int64 one after the other."""
    rows, width = bits.shape[:2]
    differs = (bits.reshape(rows, width, -1) != fill).any(axis=2)  # [N, W]
    present = differs.any(axis=1)
    first = np.where(present, differs.argmax(axis=1), 0)
    last = np.where(present, width - 1 - differs[:, ::-1].argmax(axis=1), -1)
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(np.maximum(last - first + 1, 0), out=offsets[1:])
    return first, offsets


def _one_value(gathered: np.ndarray) -> bool:
    return bool(gathered.size) and bool((gathered == gathered.flat[0]).all())


def encode(
    fields: Mapping[str, torch.Tensor | UnpaddedField],
) -> tuple[tuple[WireColumn, ...], dict[str, torch.Tensor]]:
    """The wire columns and arrays of several fields of one batch (all ``[N, ...]``; a field given
    as :class:`UnpaddedField` is encoded from its pieces); a field equal to its derivation from the
    others is a column of ``sources`` and no array."""
    tensors = {
        name: t.detach().cpu().contiguous() for name, t in fields.items() if isinstance(t, torch.Tensor)
    }
    derived = derivable(tensors)
    columns, arrays = [], {}
    for name in fields:
        if name not in tensors:
            column, field_arrays = encode_unpadded(name, fields[name])  # type: ignore[arg-type]
            columns.append(column)
            arrays.update(field_arrays)
            continue
        tensor = tensors[name]
        if name in derived:
            dtype = str(tensor.dtype).removeprefix("torch.")
            shape = tuple(tensor.shape[1:])
            columns.append(WireColumn(name, dtype, shape, dtype, False, sources=derived[name]))
            continue
        column, field_arrays = encode_field(name, tensor)
        columns.append(column)
        arrays.update(field_arrays)
    return tuple(columns), arrays


def read_columns(columns: Sequence[WireColumn], fields: Sequence[str]) -> tuple[WireColumn, ...]:
    """The stored columns of a block of ``columns`` that a fetch of ``fields`` reads: each asked
    field's own, a derived one's sources instead; each once, in the block's order."""
    by_name = {c.name: c for c in columns}
    read = set()
    for name in fields:
        read.update(by_name[name].sources or (name,))
    return tuple(c for c in columns if c.name in read)


def _ones_windows(column: WireColumn) -> bool:
    """Whether ``column`` is stored as windows of ones in rows of zeros, its values left out."""
    return column.jagged and column.constant_bits == 1 and column.fill_bits == 0


def decode_columns(
    columns: Sequence[WireColumn], fields: Sequence[str], arrays: StoredArrays, rows: np.ndarray
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The padded ``[len(rows), ...]`` tensors of ``fields`` of a block of ``columns`` (``rows``
    sorted, unique), decoded straight from its ``arrays``, one pass per stored field read
    (:func:`read_columns`) into outputs carved from one buffer, then the derived fields built from
    them; and the payload bytes read, by the stored field they were read from.

    Two derivations skip a pass: a field that is its sources side by side (``input_ids``) gets
    them decoded straight into its columns (a source also asked is copied out of them), and one
    built from a mask that is ones in windows (``position_ids``) is written from those windows
    alone (the mask is then not decoded unless asked)."""
    by_name = {c.name: c for c in columns}
    derived = [by_name[f] for f in fields if by_name[f].sources]
    of_windows = {
        c.name for c in derived if len(c.sources) == 1 and DERIVATIONS[c.name].of_windows is not None
        and _ones_windows(by_name[c.sources[0]])
    }  # fmt: skip
    into = _decoded_into(derived, by_name, of_windows)
    built = [c for c in derived if c.name not in of_windows and c.name not in into]
    own = set(fields) | {s for c in built for s in c.sources}  # the fields with an output of their own
    needed = own | {s for c in derived if c.name in into for s in c.sources}
    decoded = [c for c in read_columns(columns, fields) if c.name in needed]
    wanted = list(dict.fromkeys([*fields, *(c.name for c in decoded if c.name in own)]))  # asked first
    specs = [((len(rows), *by_name[f].shape), by_name[f].torch_dtype) for f in wanted]
    outs = dict(zip(wanted, empty_tensors(specs), strict=True))
    parts = {}
    for column in derived:
        if column.name in into:
            shapes = [by_name[s].shape for s in column.sources]
            parts.update(zip(column.sources, DERIVATIONS[column.name].parts(outs[column.name], shapes), strict=True))
    by_field = {}
    for column in decoded:
        by_field[column.name] = decode_field(column, arrays, rows, parts.get(column.name, outs.get(column.name)))
        if column.name in parts and column.name in own:
            as_bits(outs[column.name])[...] = as_bits(parts[column.name])
    for column in derived:
        if column.name in of_windows:
            (source,) = column.sources
            offsets = arrays[f"{source}.offsets"]
            lengths = offsets[rows + 1] - offsets[rows]
            build_of_windows(column.name, arrays[f"{source}.starts"][rows], lengths, outs[column.name])
            by_field.setdefault(source, 0)
        elif column.name not in into:
            build(column.name, [outs[s] for s in column.sources], outs[column.name])
    return {name: outs[name] for name in fields}, by_field


def _decoded_into(
    derived: Sequence[WireColumn], by_name: Mapping[str, WireColumn], skip: set[str]
) -> set[str]:
    """The ``derived`` fields (not in ``skip``) whose sources a fetch decodes into their columns:
    those of a derivation with ``parts`` whose sources have its dtype (so each source's bits are
    its own) and feed no other such field."""
    into, taken = set(), set()
    for column in derived:
        sources = set(column.sources)
        same_dtype = all(by_name[s].torch_dtype == column.torch_dtype for s in sources)
        if column.name not in skip and DERIVATIONS[column.name].parts and same_dtype and not sources & taken:
            into.add(column.name)
            taken |= sources
    return into


def runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """Sorted unique ``rows`` as ``[(first, stop), ...]`` runs of consecutive rows."""
    if len(rows) == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(rows)]])
    return [(int(rows[a]), int(rows[b - 1]) + 1) for a, b in zip(starts, stops, strict=True)]


StoredArrays = Mapping[str, np.ndarray]
"""A block's arrays by name, whole, as :func:`~tandem.dataplane.windows.numpy_dtype` reads them
(e.g. views of a memory map): ``{field}.values``, and ``.offsets``/``.starts`` of a jagged field."""


def decode_field(column: WireColumn, arrays: StoredArrays, rows: np.ndarray, out: torch.Tensor) -> int:
    """Write ``rows`` (sorted, unique) of one field into ``out [len(rows), *column.shape]``
    (allocated, not initialised; see :func:`~tandem.dataplane.windows.empty_tensors`), read
    straight from the block's ``arrays`` in one pass; returns the payload bytes it read (the rows'
    values; their offsets and starts are the 8 bytes a row counted apart)."""
    values = None if column.constant_bits is not None else arrays[f"{column.name}.values"]
    row_bytes = 0 if values is None else values.itemsize * int(np.prod(values.shape[1:]))  # one element
    if not column.jagged:
        rows_of_dense(values, rows, out)
        return len(rows) * row_bytes
    offsets = arrays[f"{column.name}.offsets"]
    begins, ends = offsets[rows], offsets[rows + 1]
    starts = arrays[f"{column.name}.starts"][rows]
    padded_from_windows(values, begins, ends, starts, out, column.fill_bits, column.constant_bits)
    return 0 if values is None else int((ends - begins).sum()) * row_bytes


def wire_nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Payload bytes of ``tensors`` on the wire (their values arrays once encoded)."""
    _, arrays = encode(tensors)
    return sum(a.numel() * a.element_size() for n, a in arrays.items() if n.endswith(".values"))
