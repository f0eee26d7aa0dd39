"""Dispatch modes: how one controller call is split over workers and how their outputs are collected.

A mode has two functions:

* ``split(group, args, kwargs) -> (per_rank_args, per_rank_kwargs, context)`` — one entry per
  worker rank (``None`` for a rank that does not run the call);
* ``collect(group, outputs, context) -> result`` — ``outputs`` holds the results of the ranks
  that ran, in rank order.

``aligned`` modes produce, on rank ``i``, exactly piece ``i`` of the collected result (before
padding is removed). A non-blocking call's future from an aligned mode can be fed to the next
aligned call rank by rank, so data never waits at the controller. New modes are added with
:func:`register_dispatch_mode`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.dataplane import BatchRef
from tandem.protocol import Batch
from tandem.registry import Registry

Rows = (Batch, BatchRef)  # what the data-parallel modes split: batches, or references to their rows


class GroupView(Protocol):
    """What a dispatch mode may know about the group."""

    world_size: int

    def mesh_info(self, mesh: str) -> list[MeshRank]: ...


@dataclass(frozen=True)
class MeshRank:
    """A worker's place in a named device mesh: its data-parallel rank/size and whether its output is kept."""

    dp_rank: int
    dp_size: int
    is_collect: bool


SplitFn = Callable[[GroupView, tuple, dict], tuple[list, list, Any]]
CollectFn = Callable[[GroupView, list, Any], Any]


@dataclass(frozen=True)
class DispatchMode:
    """A named pair of split and collect functions (see the module docstring)."""

    name: str
    split: SplitFn
    collect: CollectFn
    aligned: bool = False
    opaque_args: bool = False  # split passes argument values through without looking at them


class DispatchError(ValueError):
    """Bad input for a dispatch mode (wrong number of per-worker arguments, a non-Batch for a DP mode, ...)."""


DISPATCH_MODES: Registry[DispatchMode] = Registry("dispatch mode")


def register_dispatch_mode(mode: DispatchMode) -> DispatchMode:
    """Make ``mode`` available by name (``@register(dispatch="name")``); duplicate names are errors."""
    DISPATCH_MODES.register(mode.name)(mode)
    return mode


def _one_to_all_split(group: GroupView, args: tuple, kwargs: dict):
    return [args] * group.world_size, [kwargs] * group.world_size, None


def _all_outputs(group: GroupView, outputs: list, context: Any) -> list:
    return list(outputs)


def _all_to_all_split(group: GroupView, args: tuple, kwargs: dict):
    for position, value in [*enumerate(args), *kwargs.items()]:
        if not isinstance(value, (list, tuple)) or len(value) != group.world_size:
            got = (
                f"{type(value).__name__} of length {len(value)}"
                if isinstance(value, (list, tuple))
                else type(value).__name__
            )
            raise DispatchError(
                f"ALL_TO_ALL needs one value per worker ({group.world_size}) for argument {position!r}, got {got}"
            )
    per_args = [tuple(a[r] for a in args) for r in range(group.world_size)]
    per_kwargs = [{k: v[r] for k, v in kwargs.items()} for r in range(group.world_size)]
    return per_args, per_kwargs, None


def _rank_zero_split(group: GroupView, args: tuple, kwargs: dict):
    return [args] + [None] * (group.world_size - 1), [kwargs] + [None] * (group.world_size - 1), None


def _first_output(group: GroupView, outputs: list, context: Any) -> Any:
    return outputs[0]


def _require_batch(mode: str, position: Any, value: Any) -> Batch | BatchRef:
    if not isinstance(value, Rows):
        raise DispatchError(
            f"{mode} splits Batch arguments; argument {position!r} is a {type(value).__name__}, "
            "not a Batch or a BatchRef"
        )
    return value


def split_batches(mode: str, parts: int, args: tuple, kwargs: dict) -> tuple[list, list, int]:
    """Pad every Batch argument to a multiple of ``parts`` and chunk it; returns per-part args/kwargs and the pad.

    Positional arguments must be Batches or :class:`~tandem.dataplane.BatchRef` s (split the
    same way, by rewriting their row indices). Keyword arguments that are neither (settings,
    such as sampling parameters) go to every part unchanged.
    """
    settings = {k: v for k, v in kwargs.items() if not isinstance(v, Rows)}
    kwargs = {k: v for k, v in kwargs.items() if isinstance(v, Rows)}
    sizes = {len(_require_batch(mode, p, v)) for p, v in [*enumerate(args), *kwargs.items()]}
    if len(sizes) > 1:
        raise DispatchError(f"{mode}: Batch arguments have different sizes {sorted(sizes)}")
    if not sizes:
        raise DispatchError(f"{mode} needs at least one Batch argument")
    pad = 0
    chunked_args = []
    for value in args:
        padded, pad = value.pad_to_divisor(parts)
        chunked_args.append(padded.chunk(parts))
    chunked_kwargs = {}
    for key, value in kwargs.items():
        padded, pad = value.pad_to_divisor(parts)
        chunked_kwargs[key] = padded.chunk(parts)
    per_args = [tuple(c[i] for c in chunked_args) for i in range(parts)]
    per_kwargs = [{**settings, **{k: c[i] for k, c in chunked_kwargs.items()}} for i in range(parts)]
    return per_args, per_kwargs, pad


def concat_and_unpad(outputs: Sequence[Any], pad: int) -> Any:
    """Concatenate per-rank Batch (or BatchRef) outputs and drop the padding; other outputs come back
    as a list."""
    if outputs and all(isinstance(o, Batch) for o in outputs):
        return Batch.concat(list(outputs)).unpad(pad)
    if outputs and all(isinstance(o, BatchRef) for o in outputs):
        return BatchRef.concat(list(outputs)).unpad(pad)
    if pad:
        raise DispatchError(
            "a DP call padded its input but its outputs are not all Batches or all BatchRefs, "
            "so the padding cannot be removed"
        )
    return list(outputs)


def _dp_split(group: GroupView, args: tuple, kwargs: dict):
    return split_batches("DP_COMPUTE", group.world_size, args, kwargs)


def _dp_collect(group: GroupView, outputs: list, pad: int) -> Any:
    return concat_and_unpad(outputs, pad)


ONE_TO_ALL = register_dispatch_mode(
    DispatchMode("ONE_TO_ALL", _one_to_all_split, _all_outputs, opaque_args=True)
)
ALL_TO_ALL = register_dispatch_mode(DispatchMode("ALL_TO_ALL", _all_to_all_split, _all_outputs, aligned=True))
RANK_ZERO = register_dispatch_mode(
    DispatchMode("RANK_ZERO", _rank_zero_split, _first_output, opaque_args=True)
)
DP_COMPUTE = register_dispatch_mode(DispatchMode("DP_COMPUTE", _dp_split, _dp_collect, aligned=True))


def check_mesh_places(mesh: str, ranks: Sequence[MeshRank]) -> int:
    """The data-parallel size the ranks of ``mesh`` declared; raises :class:`DispatchError` unless
    they agree on it and each data-parallel rank is collected exactly once (a place table that
    would drop or repeat rows)."""
    sizes = sorted({place.dp_size for place in ranks})
    if len(sizes) != 1:
        raise DispatchError(f"the ranks of mesh {mesh!r} declare different data-parallel sizes {sizes}")
    collected = sorted(place.dp_rank for place in ranks if place.is_collect)
    if collected != list(range(sizes[0])):
        raise DispatchError(
            f"the collected ranks of mesh {mesh!r} report data-parallel ranks {collected}: each of "
            f"0..{sizes[0] - 1} must be collected exactly once"
        )
    return sizes[0]


def mesh_dispatch(mesh: str) -> DispatchMode:
    """Data parallel over a named mesh: rank ``r`` gets chunk ``dp_rank(r)``; only ``is_collect`` ranks' outputs are kept.

    Workers declare their place with :meth:`Worker.set_mesh_rank` (e.g. tensor-parallel
    ranks share a dp rank and only tp-rank 0 is collected); an engine's workers declare the place
    their engine's ``ParallelDims`` gives them (``tandem.engine.on_rank.mesh_place``). The places
    are checked (:func:`check_mesh_places`), never worked out here.
    """
    name = f"mesh:{mesh}"

    def split(group: GroupView, args: tuple, kwargs: dict):
        ranks = group.mesh_info(mesh)
        dp_size = check_mesh_places(mesh, ranks)
        chunk_args, chunk_kwargs, pad = split_batches(name, dp_size, args, kwargs)
        return [chunk_args[m.dp_rank] for m in ranks], [chunk_kwargs[m.dp_rank] for m in ranks], pad

    def collect(group: GroupView, outputs: list, pad: int):
        ranks = group.mesh_info(mesh)
        kept = sorted((m.dp_rank, out) for m, out in zip(ranks, outputs, strict=True) if m.is_collect)
        return concat_and_unpad([out for _, out in kept], pad)

    if name in DISPATCH_MODES:
        return DISPATCH_MODES.get(name)
    return register_dispatch_mode(DispatchMode(name, split, collect))


def resolve_mode(mode: str | DispatchMode) -> DispatchMode:
    """A mode object from itself or its registered name."""
    return mode if isinstance(mode, DispatchMode) else DISPATCH_MODES.get(mode)
