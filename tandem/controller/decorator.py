"""``@register``: declare how a worker method is dispatched, executed and awaited."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tandem.controller.dispatch import DispatchMode, resolve_mode

F = TypeVar("F", bound=Callable)
EXECUTE_MODES = ("all", "rank_zero")
OUTPUT_MODES = ("value", "ref")
SPEC_ATTR = "__tandem_method_spec__"


@dataclass(frozen=True)
class MethodSpec:
    """How a group call of this method runs: its dispatch mode, which ranks execute, whether it
    blocks, the fields it reads from a :class:`~tandem.dataplane.BatchRef` argument (``None``: all)
    and whether its output Batch returns as a value or stays in the rank's store (``ref``)."""

    dispatch: DispatchMode
    execute: str
    blocking: bool
    reads: tuple[str, ...] | None = None
    outputs: str = "value"


def register(
    dispatch: str | DispatchMode = "ONE_TO_ALL",
    execute: str = "all",
    blocking: bool = True,
    reads: tuple[str, ...] | None = None,
    outputs: str = "value",
) -> Callable[[F], F]:
    """Expose a worker method on its ``WorkerGroup``.

    Args:
        dispatch: a dispatch mode or its name (``ONE_TO_ALL``, ``ALL_TO_ALL``, ``DP_COMPUTE``,
            ``RANK_ZERO``, ``mesh_dispatch("name")`` or a registered custom mode).
        execute: ``all`` ranks run the call, or ``rank_zero`` only.
        blocking: wait for the result (True), or return a :class:`GroupFuture` at once.
        reads: the fields the method reads. A :class:`~tandem.dataplane.BatchRef` argument
            reaches it as the padded ``Batch`` of only these fields of only this rank's rows,
            fetched by the rank itself (``None``: every field). Batch arguments are unchanged.
        outputs: ``value`` (the result travels back) or ``ref``: when a ``BatchRef`` argument
            reached the method, a ``Batch`` result is put into the rank's store and a ``BatchRef``
            travels back instead (called with Batches, the ``Batch`` travels back as before).
    """
    mode = resolve_mode(dispatch)
    if execute not in EXECUTE_MODES:
        raise ValueError(f"register(execute={execute!r}) is not allowed; choose one of {list(EXECUTE_MODES)}")
    if outputs not in OUTPUT_MODES:
        raise ValueError(f"register(outputs={outputs!r}) is not allowed; choose one of {list(OUTPUT_MODES)}")
    if reads is not None and (isinstance(reads, str) or not all(isinstance(f, str) for f in reads)):
        raise ValueError(f"register(reads={reads!r}) must be a tuple of field names")

    def decorator(fn: F) -> F:
        spec = MethodSpec(mode, execute, blocking, None if reads is None else tuple(reads), outputs)
        setattr(fn, SPEC_ATTR, spec)
        return fn

    return decorator


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Every ``@register``-ed method of ``cls`` (inherited ones included) with its spec."""
    methods = {}
    for name in dir(cls):
        spec = getattr(getattr(cls, name, None), SPEC_ATTR, None)
        if isinstance(spec, MethodSpec):
            methods[name] = spec
    return methods
