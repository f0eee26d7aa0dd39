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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NARROW = (torch.uint8, torch.int16, torch.int32, torch.int64)


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
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    wire: str
    jagged: bool
    fill_bits: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def wire_dtype(self) -> torch.dtype:
        return getattr(torch, self.wire)

    def arrays(self) -> tuple[str, ...]:
        """The names of the stored arrays of this field."""
        return (
            (f"{self.name}.values", f"{self.name}.offsets", f"{self.name}.starts")
            if self.jagged
            else (f"{self.name}.values",)
        )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as signed integers of the element's width (bit-exact comparisons)."""
    return tensor.contiguous().view(_BITS[tensor.element_size()])


def _narrowest(values: torch.Tensor) -> torch.dtype:
    """The narrowest integer wire dtype holding every value of integer ``values``."""
    if values.dtype == torch.bool or values.numel() == 0:
        return torch.uint8
    low, high = int(values.min()), int(values.max())
    for dtype in _NARROW:
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype
    return values.dtype


def _wire_values(values: torch.Tensor) -> torch.Tensor:
    if values.is_floating_point() or values.is_complex():
        return values.contiguous()
    return values.to(_narrowest(values)).contiguous()


def _fill_bits(bits: torch.Tensor) -> int:
    """The most common first element of the rows' first and last positions (the pad)."""
    edges = torch.cat([bits[:, 0].reshape(len(bits), -1)[:, 0], bits[:, -1].reshape(len(bits), -1)[:, 0]])
    values, counts = torch.unique(edges, return_counts=True)
    return int(values[counts.argmax()])


def encode_field(name: str, tensor: torch.Tensor) -> tuple[WireColumn, dict[str, torch.Tensor]]:
    """The wire column of ``tensor [N, ...]`` and its arrays (see the module docstring)."""
    tensor = tensor.detach().cpu()
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.ndim < 2 or tensor.shape[0] == 0 or tensor.shape[1] == 0:
        values = _wire_values(tensor)
        column = WireColumn(
            name, dtype, tuple(tensor.shape[1:]), str(values.dtype).removeprefix("torch."), False
        )
        return column, {f"{name}.values": values}
    rows, width = tensor.shape[:2]
    bits = _bits(tensor)
    fill = _fill_bits(bits)
    differs = (bits != fill).reshape(rows, width, -1).any(dim=-1)  # [N, W]
    present = differs.any(dim=1)
    first = torch.where(present, differs.int().argmax(dim=1), 0)
    last = torch.where(present, width - 1 - differs.flip(1).int().argmax(dim=1), -1)
    lengths = (last - first + 1).clamp(min=0)
    positions = torch.arange(width)
    window = (positions >= first[:, None]) & (positions < (first + lengths)[:, None])
    values = _wire_values(tensor[window])
    offsets = torch.zeros(rows + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    column = WireColumn(
        name, dtype, tuple(tensor.shape[1:]), str(values.dtype).removeprefix("torch."), True, fill
    )
    arrays = {f"{name}.values": values, f"{name}.offsets": offsets, f"{name}.starts": first.to(torch.int32)}
    return column, arrays


def encode(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[WireColumn, ...], dict[str, torch.Tensor]]:
    """The wire columns and arrays of several fields of one batch (all ``[N, ...]``)."""
    columns, arrays = [], {}
    for name, tensor in tensors.items():
        column, field_arrays = encode_field(name, tensor)
        columns.append(column)
        arrays.update(field_arrays)
    return tuple(columns), arrays


Reader = Callable[[str, int, int], torch.Tensor]
"""``read(array_name, start, stop)``: elements ``[start, stop)`` (dim 0) of a stored array."""


def runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """Sorted unique ``rows`` as ``[(first, stop), ...]`` runs of consecutive rows."""
    if len(rows) == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(rows)]])
    return [(int(rows[a]), int(rows[b - 1]) + 1) for a, b in zip(starts, stops, strict=True)]


def select_rows(read: Reader, columns: Sequence[WireColumn], rows: np.ndarray) -> dict[str, torch.Tensor]:
    """The compact arrays of ``rows`` (sorted, unique) of ``columns``, read run by run.

    Returns, per jagged field, ``values`` of the rows, ``lengths [n] int32`` and ``starts [n]
    int32``; per dense field, ``values [n, ...]``. Only these rows' bytes are read.
    """
    out: dict[str, torch.Tensor] = {}
    spans = runs(rows)
    for column in columns:
        name = column.name
        if not column.jagged:
            out[f"{name}.values"] = _cat([read(f"{name}.values", a, b) for a, b in spans], column, read)
            continue
        values, lengths, starts = [], [], []
        for a, b in spans:
            offsets = read(f"{name}.offsets", a, b + 1)
            values.append(read(f"{name}.values", int(offsets[0]), int(offsets[-1])))
            lengths.append((offsets[1:] - offsets[:-1]).to(torch.int32))
            starts.append(read(f"{name}.starts", a, b))
        out[f"{name}.values"] = _cat(values, column, read)
        out[f"{name}.lengths"] = torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.int32)
        out[f"{name}.starts"] = torch.cat(starts) if starts else torch.zeros(0, dtype=torch.int32)
    return out


def _cat(parts: list[torch.Tensor], column: WireColumn, read: Reader) -> torch.Tensor:
    if parts:
        return torch.cat(parts)
    return read(f"{column.name}.values", 0, 0)


def decode(column: WireColumn, compact: Mapping[str, torch.Tensor], rows: int) -> torch.Tensor:
    """The padded ``[rows, *column.shape]`` tensor of one field from :func:`select_rows` output."""
    values = compact[f"{column.name}.values"].to(column.torch_dtype)
    if not column.jagged:
        return values.reshape(rows, *column.shape)
    # filled through the integer view of the dtype, so a NaN fill keeps its exact bits
    out = torch.full((rows, *column.shape), column.fill_bits, dtype=_BITS[values.element_size()])
    out = out.view(column.torch_dtype)
    lengths = compact[f"{column.name}.lengths"].long()
    starts = compact[f"{column.name}.starts"].long()
    positions = torch.arange(column.shape[0])
    window = (positions >= starts[:, None]) & (positions < (starts + lengths)[:, None])  # [rows, W]
    trailing = len(column.shape) - 1
    out.masked_scatter_(window.reshape(*window.shape, *([1] * trailing)).expand(out.shape), values)
    return out


def payload_nbytes(compact: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """``(payload, index)`` bytes of compact arrays: the fields' values, and lengths/starts."""
    payload = index = 0
    for name, array in compact.items():
        nbytes = array.numel() * array.element_size()
        if name.endswith(".values"):
            payload += nbytes
        else:
            index += nbytes
    return payload, index


def wire_nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Payload bytes of ``tensors`` on the wire (their values arrays once encoded)."""
    _, arrays = encode(tensors)
    return sum(a.numel() * a.element_size() for n, a in arrays.items() if n.endswith(".values"))
