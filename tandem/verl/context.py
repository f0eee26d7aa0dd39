"""``Context``: what the joint translators of verl's keys read and write."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Context:
    """What the joint translators read and write."""

    values: dict[str, Any]
    given: set[str]
    out: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def get(self, key: str, default: Any = None) -> Any:
        """verl's value of ``key`` (the command's, else verl's default), or ``default``."""
        return self.values.get(key, default)

    def set_by_user(self, key: str) -> bool:
        """Whether the command gave ``key`` itself."""
        return key in self.given
