"""Argument choices read lazily from the registries they come from (building the parser must not
load torch)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence


class ChoicesFrom(Sequence[str]):
    """An argument's choices, read from their one source of truth (``module.name``) the first
    time argparse needs them: to check a given value, or to print the command's help. Those
    modules load torch, and building the parser must not, so ``tandem --help`` and the other
    commands' arguments answer at once. The argument needs a ``metavar`` (argparse formats one
    when the argument is added); ``%(choices)s`` puts the names in its help."""

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name

    @functools.cached_property
    def _names(self) -> tuple[str, ...]:
        return tuple(getattr(importlib.import_module(self.module), self.name))

    def __getitem__(self, index):  # type: ignore[override]
        return self._names[index]

    def __len__(self) -> int:
        return len(self._names)
