"""A name -> function registry: duplicate names are an error, unknown names list the known ones.

A registered function may also answer to aliases: another project's name for the same math (verl
calls the k3 KL estimator ``low_var_kl``). Configs store the registered name
(:meth:`Registry.canonical`), and a name given as an alias is reported once on the
``tandem.names`` logger, which the command line prints as a note.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)

NAMES_LOG = logging.getLogger("tandem.names")


class Registry(Generic[F]):
    """Functions registered by name for one input contract (advantages, policy losses, ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, aliases: Iterable[str] = ()) -> Callable[[F], F]:
        """Decorator that registers a function under ``name`` (and ``aliases``, other projects'
        names for it); a name or alias used twice raises."""

        def decorator(fn: F) -> F:
            self._claim(name)
            self._entries[name] = fn
            for alias in aliases:
                self.add_alias(alias, name)
            return fn

        return decorator

    def add_alias(self, alias: str, name: str) -> None:
        """Let ``alias`` name the function registered as ``name``."""
        if name not in self._entries:
            raise ValueError(f"{self.kind} alias {alias!r}: {name!r} is not registered")
        self._claim(alias)
        self._aliases[alias] = name

    def _claim(self, name: str) -> None:
        if name in self._entries or name in self._aliases:
            holder = self._entries.get(name) or self._aliases[name]
            raise ValueError(
                f"{self.kind} {name!r} is already registered (by {getattr(holder, '__qualname__', holder)!r})"
            )

    def canonical(self, name: str, key: str | None = None) -> str:
        """The registered name ``name`` stands for (itself, or an alias's target); ``ValueError``
        listing the known names (and the closest one) otherwise. ``key`` (the config key that gave it) names it in the
        error, and a note on ``tandem.names`` says what tandem calls an alias given there."""
        if name in self._entries:
            return name
        if name in self._aliases:
            target = self._aliases[name]
            if key is not None:
                NAMES_LOG.info("%s=%s: tandem calls this %s %r", key, name, self.kind, target)
            return target
        aliases = f" (aliases: {sorted(self._aliases)})" if self._aliases else ""
        close = difflib.get_close_matches(str(name), [*self._entries, *self._aliases], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        if key is None:
            raise ValueError(
                f"unknown {self.kind} {name!r}; registered: {sorted(self._entries)}{aliases}{hint}"
            )
        raise ValueError(
            f"{key}={name!r} is not registered; choose one of {sorted(self._entries)}{aliases}{hint}"
        )

    def get(self, name: str) -> F:
        """The function registered as ``name`` (or aliased by it); ``ValueError`` listing known names otherwise."""
        return self._entries[self.canonical(name)]

    def names(self) -> list[str]:
        """The registered names (aliases left out)."""
        return sorted(self._entries)

    def aliases(self) -> dict[str, str]:
        """Every alias and the registered name it stands for."""
        return dict(sorted(self._aliases.items()))

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
