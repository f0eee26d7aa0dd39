"""Checking override keys against a dataclass schema before any merge, so a bad key gets one
clear message: the key, the group it is not in, and the nearest real names."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any


def check_override_keys(schema: type, overrides: Sequence[str]) -> None:
    """Raise ``ValueError`` for the first ``key=value`` whose key (``+``/``++``/``~`` prefixes
    aside) is not a field path of ``schema``, or that sets a whole group to one value."""
    for item in overrides:
        key, _, value = item.partition("=")
        _check_path(schema, key.lstrip("+~"), value, removing=key.startswith("~"))


def _check_path(schema: type, path: str, value: str, removing: bool) -> None:
    parts = path.split(".")
    node: Any = schema
    for depth, part in enumerate(parts):
        here = ".".join(parts[: depth + 1])
        fields = {f.name for f in dataclasses.fields(node)}
        if part not in fields:
            group = ".".join(parts[:depth])
            close = [
                ".".join([*parts[:depth], name]) for name in difflib.get_close_matches(part, fields, n=3)
            ]
            hint = (
                f"; did you mean {' or '.join(close)}?"
                if close
                else f"; its keys: {', '.join(sorted(fields))}"
            )
            where = f"{group} ({node.__name__})" if group else node.__name__
            raise ValueError(f"{path} is not a setting: {where} has no field {part!r}{hint}")
        kind = unwrap_optional(typing.get_type_hints(node)[part])
        if _is_open_mapping(kind):
            return  # a free-form dict: any deeper key is the user's
        last = depth == len(parts) - 1
        if last:
            if dataclasses.is_dataclass(kind) and not removing:
                names = [f.name for f in dataclasses.fields(kind)]
                example = "name" if "name" in names else names[0]
                raise ValueError(
                    f"{here} is a group of settings, not one value; set its fields, "
                    f"e.g. {here}.{example}={value}"
                )
            return
        if not dataclasses.is_dataclass(kind):
            raise ValueError(f"{path} is not a setting: {here} is a single value, not a group")
        node = kind


def unwrap_optional(kind: Any) -> Any:
    """``X | None`` → ``X``; anything else unchanged."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return kind


def _is_open_mapping(kind: Any) -> bool:
    origin = typing.get_origin(kind) or kind
    return isinstance(origin, type) and issubclass(origin, Mapping)
