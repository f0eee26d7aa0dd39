"""A data-path setting (one file, or a list of files read in order as one dataset) as a tuple of paths."""

from __future__ import annotations

import os
from typing import Any


def file_list(value: Any, setting: str) -> tuple[str, ...]:
    """``value`` — a path, or a list (or tuple) of paths as in verl's ``data.train_files`` — as a
    tuple of paths, in order; an empty string is no file. ``ValueError`` naming ``setting`` (and
    the entry) for anything else, or for an entry that is not a non-empty path."""
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        return (path,) if path else ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{setting} must be a file path or a list of them, got {type(value).__name__}")
    for index, path in enumerate(value):
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(f"{setting}[{index}] must be a file path (a non-empty string), got {path!r}")
    return tuple(os.fspath(path) for path in value)
