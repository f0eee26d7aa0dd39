"""``@register``: declare how a worker method is dispatched, executed and awaited."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tandem.controller.dispatch import DispatchMode, resolve_mode

F = TypeVar("F", bound=Callable)
EXECUTE_MODES = ("all", "rank_zero")
SPEC_ATTR = "__tandem_method_spec__"


@dataclass(frozen=True)
class MethodSpec:
    """How a group call of this method runs: its dispatch mode, which ranks execute, and whether it blocks."""

    dispatch: DispatchMode
    execute: str
    blocking: bool


def register(
    dispatch: str | DispatchMode = "ONE_TO_ALL", execute: str = "all", blocking: bool = True
) -> Callable[[F], F]:
    """Expose a worker method on its ``WorkerGroup``.

    Args:
        dispatch: a dispatch mode or its name (``ONE_TO_ALL``, ``ALL_TO_ALL``, ``DP_COMPUTE``,
            ``RANK_ZERO``, ``mesh_dispatch("name")`` or a registered custom mode).
        execute: ``all`` ranks run the call, or ``rank_zero`` only.
        blocking: wait for the result (True), or return a :class:`GroupFuture` at once.
    """
    mode = resolve_mode(dispatch)
    if execute not in EXECUTE_MODES:
        raise ValueError(f"register(execute={execute!r}) is not allowed; choose one of {list(EXECUTE_MODES)}")

    def decorator(fn: F) -> F:
        setattr(fn, SPEC_ATTR, MethodSpec(mode, execute, blocking))
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
