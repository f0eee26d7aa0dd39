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
    never a half-written ``target``; an exception in the body (a full disk) removes the ``.tmp``.
    """
    target = Path(target)
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        remove_freeing(staging)  # an error in the body (a full disk): no ``.tmp`` is left
        raise
    previous = target.with_name(target.name + ".old")
    shutil.rmtree(previous, ignore_errors=True)
    if target.exists():
        target.rename(previous)
    staging.rename(target)
    shutil.rmtree(previous, ignore_errors=True)


def remove_freeing(directory: str | os.PathLike) -> None:
    """Remove ``directory``, emptying its files first: a failed writer may keep one open (torch's
    zip writer leaks its descriptor on a full disk), and unlinking alone frees no space until that
    process ends."""
    directory = Path(directory)
    for file in directory.rglob("*") if directory.is_dir() else []:
        with contextlib.suppress(OSError):
            if file.is_file() and not file.is_symlink():
                os.truncate(file, 0)
    shutil.rmtree(directory, ignore_errors=True)
