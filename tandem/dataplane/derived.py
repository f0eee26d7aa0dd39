"""Fields a block does not store because the reader derives them from others of the same block.

The protocol's padded layout (:mod:`tandem.protocol.sequences`) repeats itself:
``input_ids [B, P+R]`` is ``cat(prompts [B, P], responses [B, R])``, and ``position_ids [B, S]``
is ``clamp(cumsum(attention_mask) - 1, 0)``. Stored as they were, these two were 10.5 of the 17.1
bytes per real response token that ``bench/data_plane.py``'s log-prob stage read (docs/data-plane.md,
"Measured"). So :func:`derivable` checks, when
a block is encoded, whether a field equals its derivation from the block's other fields, bit for
bit; if it does, the block stores no array of it, only the names of its sources
(:class:`~tandem.dataplane.columns.WireColumn`'s ``sources``), and a fetch of it reads the
sources' bytes instead and builds it on the reader (:func:`build`). A field that differs (an
agent episode's positions, a VLM's ``[B, 3, S]`` rope positions, ids of another layout) is stored
as before. Either way the reader gets the tensor that was put.

A source is never itself derived (no derivation names a derived field as a source), so one level
of sources is all a fetch reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch


def _concat_shape(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...] | None:
    prompts, responses = shapes
    if len(prompts) != 2 or len(responses) != 2 or prompts[0] != responses[0]:
        return None
    return (prompts[0], prompts[1] + responses[1])


def _concat(sources: Sequence[np.ndarray], out: np.ndarray) -> None:
    """``out [B, P+R] = cat(prompts [B, P], responses [B, R])``."""
    prompts, responses = sources
    width = prompts.shape[1]
    out[:, :width] = prompts
    out[:, width:] = responses


def _concat_parts(out: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """``out [B, P+R]``'s ``[B, P]`` and ``[B, R]`` column views, where prompts and responses go."""
    width = shapes[0][0]
    return [out[:, :width], out[:, width:]]


def _positions_shape(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...] | None:
    (mask,) = shapes
    return mask if len(mask) == 2 else None


def _positions(sources: Sequence[np.ndarray], out: np.ndarray) -> None:
    """``out [B, S] = clamp(cumsum(attention_mask [B, S]) - 1, 0)``, as ``sequence_tensors`` writes it."""
    (mask,) = sources
    np.cumsum(mask, axis=1, out=out)
    out -= 1
    np.maximum(out, 0, out=out)


def _positions_of_windows(starts: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> None:
    """:func:`_positions` of a mask that is ones on ``[starts[i], starts[i] + lengths[i])`` of row
    ``i`` and zeros elsewhere, from those windows: 0 up to the window's first column, then 1, 2,
    ..., the window's last position, held to the row's end. Three slice writes a row, each byte
    written once: ~5x faster than the cumulative sum (0.3 against 1.5 ms at 128 x 4096)."""
    ramp = np.arange(out.shape[1], dtype=out.dtype)
    for row, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
        out[row, :start] = 0
        out[row, start : start + length] = ramp[:length]
        out[row, start + length :] = max(length - 1, 0)


@dataclass(frozen=True)
class Derivation:
    """A field built from ``sources``: ``shape`` of the sources' shapes (``None``: they do not
    fit), ``write(sources, out)`` fills ``out`` (numpy integers, the field's dtype); for a field
    of one source that is ones in one window a row and 0 elsewhere (a mask stored as its windows
    alone), ``of_windows(starts, lengths, out)`` writes the same from those windows; and for a
    field that is its sources side by side, ``parts(out, source_shapes)`` gives the views of
    ``out`` its sources are, so that a fetch decodes them straight into ``out`` (one pass fewer
    than decoding them apart and writing ``out`` from them: :func:`tandem.dataplane.columns.decode_columns`)."""

    sources: tuple[str, ...]
    shape: Callable[[Sequence[tuple[int, ...]]], tuple[int, ...] | None]
    write: Callable[[Sequence[np.ndarray], np.ndarray], None]
    of_windows: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None
    parts: Callable[[torch.Tensor, Sequence[tuple[int, ...]]], list[torch.Tensor]] | None = None


DERIVATIONS: dict[str, Derivation] = {
    "input_ids": Derivation(("prompts", "responses"), _concat_shape, _concat, parts=_concat_parts),
    "position_ids": Derivation(("attention_mask",), _positions_shape, _positions, _positions_of_windows),
}


def _integer(tensor: torch.Tensor) -> bool:
    return not (tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool)


def build(name: str, sources: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Write field ``name`` derived from its ``sources`` (CPU tensors, in its derivation's order)
    into ``out`` (its shape and integer dtype, allocated) and return ``out``; numpy, on the
    calling thread, as the decode (:mod:`tandem.dataplane.windows` says why)."""
    DERIVATIONS[name].write([s.numpy() for s in sources], out.numpy())
    return out


def build_of_windows(name: str, starts: np.ndarray, lengths: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """Field ``name`` written into ``out`` from its one source's windows of ones (``[n]`` each; see
    :class:`Derivation`), and returned."""
    DERIVATIONS[name].of_windows(np.asarray(starts, np.int64), np.asarray(lengths, np.int64), out.numpy())
    return out


def derivable(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, ...]]:
    """The fields of ``tensors`` (CPU, contiguous, one block's) equal, bit for bit, to their
    derivation from others of ``tensors``: ``{field: sources}``. One derivation and one comparison
    per candidate field."""
    found = {}
    for name, derivation in DERIVATIONS.items():
        target = tensors.get(name)
        sources = [tensors.get(s) for s in derivation.sources]
        if target is None or any(s is None for s in sources):
            continue
        if not _integer(target) or not all(_integer(s) or s.dtype == torch.bool for s in sources):
            continue
        if derivation.shape([tuple(s.shape) for s in sources]) != tuple(target.shape):
            continue
        if torch.equal(build(name, sources, torch.empty_like(target)), target):
            found[name] = derivation.sources
    return found
