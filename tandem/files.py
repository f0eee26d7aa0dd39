"""Whole directories (an exported model, a checkpoint) written atomically."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yields a staging directory next to ``target``; once the body finishes it replaces ``target``.

    A crash mid-write leaves the previous ``target`` (or none) in place and a ``.tmp`` sibling,
    never a half-written ``target``.
    """
    target = Path(target)
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    yield staging
    previous = target.with_name(target.name + ".old")
    shutil.rmtree(previous, ignore_errors=True)
    if target.exists():
        target.rename(previous)
    staging.rename(target)
    shutil.rmtree(previous, ignore_errors=True)
