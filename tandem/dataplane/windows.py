"""Padded tensors written from jagged windows, one pass per field: the data plane's decode.

A jagged field's rows are windows of one flat ``values [T, *trailing]`` array: row ``i`` is
``values[begins[i]:ends[i]]``, placed at ``starts[i]`` of a padded row of ``width`` fill values
(:mod:`tandem.dataplane.columns` describes the wire form).

How, and why so (CPU time, one process, the bench's shapes: 128 rows x 4096 tokens of five
fields). The outputs of one fetch are allocated once (:func:`empty_tensors`), filled with the
fill value in one call per field, and each run of windows is copied in by one casting copy (wire
int32 into the int64 row, say; rows whose windows touch both in the output and in ``values``, as
rows of full length do, are one run). The source is read once, straight from where it lies (a
memory map of a block's file, a Ray object). This is 4-6x faster than scattering the windows
through a ``[rows, width]`` boolean mask (``masked_scatter_``, or numpy's boolean assignment),
which builds the mask and makes several passes. Filling only the gaps between windows writes
each byte once but costs a second numpy call (~1 us) per row: measured interleaved at 128 x 4096,
256 x 2048, 64 x 16384 and 256 x 16384, it was never faster, and 25% slower on 256 x 2048.

The copies are numpy's, on the calling thread only: torch's OpenMP team, which on a machine of
few cores shared with other processes made the old torch decode many times slower, is never
involved, and no thread setting is changed.

Every array here is handled as integers of its element's width (:func:`as_bits`): ``bfloat16`` and
``bool`` have no numpy twin, and a NaN fill keeps its exact bits. Integer wire values are cast to
the output's width by numpy's wrapping assignment, which keeps their two's-complement bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_TORCH_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_INTS = {torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a stored array of torch ``dtype`` is read as: itself for the wire's integers
    (``uint8``/``int16``/``int32``/``int64``), otherwise the integer of its element width."""
    if dtype in _NUMPY_INTS:
        return np.dtype(_NUMPY_INTS[dtype])
    return np.dtype(_NUMPY_INTS[_TORCH_BITS[torch.empty((), dtype=dtype).element_size()]])


def as_bits(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of ``tensor``'s memory as integers of its element's width (``uint8`` for one
    byte, signed otherwise: the widths the wire's fill bits are taken in)."""
    bits = _TORCH_BITS[tensor.element_size()]
    return (tensor if tensor.dtype == bits else tensor.view(bits)).numpy()


def empty_tensors(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Uninitialised tensors of ``(shape, dtype)`` ``specs`` for the decode to fill, carved out of
    one buffer that numpy allocates (each 64-byte aligned).

    Why not ``torch.empty`` per tensor: for arrays of a few MiB glibc maps fresh pages on many
    requests, and the decode then paid one page fault per 4 KiB of its output. On this project's
    machine that is ~3 us a fault: 4,600 faults, ~13 ms, for an 18.9 MB batch whose copies take
    ~3 ms. numpy asks arrays of 4 MiB and more for transparent huge pages (``madvise``), and one
    buffer for a whole fetch is large enough for that to count: fresh, it faults once per 2 MiB;
    reused, not at all. The tensors share the buffer (it lives while any of them does) and, like
    any ``from_numpy`` tensor, cannot be resized in place.
    """
    places, total = [], 0
    for shape, dtype in specs:
        itemsize = torch.empty((), dtype=dtype).element_size()
        places.append((total, itemsize))
        total += (int(np.prod(shape)) * itemsize + 63) // 64 * 64
    buffer = np.empty(total, dtype=np.uint8)
    tensors = []
    for (shape, dtype), (offset, itemsize) in zip(specs, places, strict=True):
        if 0 in shape:  # numpy gives an empty array zero strides, which a torch view refuses
            tensors.append(torch.empty(shape, dtype=dtype))
            continue
        bits = buffer[offset : offset + int(np.prod(shape)) * itemsize].view(
            numpy_dtype(_TORCH_BITS[itemsize])
        )
        tensor = torch.from_numpy(bits.reshape(shape))
        tensors.append(tensor if tensor.dtype == dtype else tensor.view(dtype))
    return tensors


def padded_from_windows(
    values: np.ndarray,
    begins: np.ndarray,
    ends: np.ndarray,
    starts: np.ndarray,
    out: torch.Tensor,
    fill_bits: int,
    constant_bits: int | None = None,
) -> torch.Tensor:
    """Write ``n`` windows into ``out [n, width, *trailing]`` (allocated, not initialised) and
    return it. ``out`` is contiguous, or ``[n, width]`` columns of wider contiguous rows (a
    derived field's part: :func:`tandem.dataplane.derived.Derivation`), whose other columns are
    left as they are.

    Args:
        values: ``[T, *trailing]`` the stored values (wire integers, or a float's bits); unread
            (``None``) when ``constant_bits`` is given.
        begins, ends: ``[n]`` int64, row ``i``'s values are ``values[begins[i]:ends[i]]``.
        starts: ``[n]`` where row ``i``'s window begins in its padded row.
        out: the padded output; everything outside the windows gets ``fill_bits``.
        fill_bits: the fill value's bits, as the integer of the element's width (see :func:`as_bits`).
        constant_bits: every element inside the windows is this value's bits (a field stored
            without values: :mod:`tandem.dataplane.columns`).
    """
    rows, width = out.shape[0], out.shape[1]
    if rows == 0:
        return out
    begins, ends = np.asarray(begins, np.int64), np.asarray(ends, np.int64)
    starts = np.asarray(starts, np.int64)
    lengths = ends - begins
    if lengths.min() < 0 or starts.min() < 0 or (starts + lengths).max() > width:
        raise ValueError(f"windows outside rows of width {width}: the block is corrupt")
    bits = as_bits(out)
    bits.fill(fill_bits)
    if out.is_contiguous():
        flat, row_step = bits.reshape(rows * width, *out.shape[2:]), width
    elif out.dim() == 2 and out.stride(1) == 1:  # the rows' elements as one run of the wider rows
        row_step = out.stride(0)
        flat = np.lib.stride_tricks.as_strided(bits, ((rows - 1) * row_step + width,), (bits.itemsize,))
    else:
        raise ValueError(f"windows go into contiguous rows, got strides {out.stride()} for {tuple(out.shape)}")
    for lo, hi, begin in _runs(starts, lengths, begins, row_step):
        if hi > lo:
            flat[lo:hi] = values[begin : begin + hi - lo] if constant_bits is None else constant_bits
    return out


def windows_of_padded(padded: np.ndarray, starts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The rows' windows of ``padded [n, width, *trailing]`` one after the other, ``[T, *trailing]``
    (the encode's one pass: the inverse of :func:`padded_from_windows`).

    Args:
        starts: ``[n]`` where row ``i``'s window begins.
        offsets: ``[n + 1]`` int64, row ``i``'s window goes to ``values[offsets[i]:offsets[i + 1]]``.
    """
    rows, width = padded.shape[0], padded.shape[1]
    values = np.empty((int(offsets[-1]), *padded.shape[2:]), dtype=padded.dtype)
    flat = padded.reshape(rows * width, *padded.shape[2:])
    for lo, hi, begin in _runs(starts, np.diff(offsets), offsets[:-1], width):
        values[begin : begin + hi - lo] = flat[lo:hi]
    return values


def _runs(starts: np.ndarray, lengths: np.ndarray, begins: np.ndarray, width: int) -> zip:
    """``(low, high, begin)`` of each run of windows, as Python ints: the windows of ``[n]`` rows
    (``lengths`` elements from ``begins`` in the values, at ``starts`` in rows that begin every
    ``width`` elements) span ``[low, high)`` of the flattened rows; a run joins the windows that
    touch in both."""
    rows = len(starts)
    if rows == 0:
        return zip((), (), (), strict=True)
    low = np.arange(rows, dtype=np.int64) * width + starts
    high = low + lengths
    new_run = np.ones(rows, dtype=bool)
    new_run[1:] = (low[1:] != high[:-1]) | (begins[1:] != begins[:-1] + lengths[:-1])
    first = np.flatnonzero(new_run)
    last = np.append(first[1:], rows) - 1
    return zip(low[first].tolist(), high[last].tolist(), begins[first].tolist(), strict=True)


def rows_of_dense(values: np.ndarray, rows: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """Write ``values[rows]`` (``[N, *trailing]`` stored, ``rows`` sorted) into ``out [n, *trailing]``
    and return it; a range of rows is one copy."""
    target = as_bits(out)
    if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
        target[...] = values[int(rows[0]) : int(rows[-1]) + 1]
    elif len(rows):
        target[...] = values[rows]
    return out
