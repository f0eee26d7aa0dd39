"""Trainer checkpoints, for every trainer: ``<output_dir>/checkpoints/global_step_<k>/`` with the
engines' states (the RL trainer's ``actor/`` and ``critic/``, the SFT-family trainers' ``engine/``:
model, optimizer, scheduler, RNG) and ``trainer_state.json`` (step, sampler, KL controller, ...).

A checkpoint is assembled in ``global_step_<k>.tmp`` and renamed into place only when complete,
then the ``latest`` pointer is replaced atomically: a crash at any point leaves the previous
checkpoint usable, and resume ignores a half-written one. Only the newest ``keep_last`` stay
(``0``: every one).

The last file written is ``manifest.json``: every other file's path and size. A checkpoint is
*intact* when each listed file is there with its size and ``trainer_state.json`` parses
(:meth:`CheckpointManager.problem`; cheap: sizes only, no tensor is read). Resuming from the latest
(:meth:`CheckpointManager.resume_point`) skips a damaged one (a truncated or deleted shard),
naming it, for the newest intact one; a checkpoint asked for by path is refused naming what is
wrong (:meth:`CheckpointManager.check_intact`). A checkpoint written before manifests existed is
checked by its ``trainer_state.json`` only.

A save that fails (a full disk, most often) removes its staging directory, so the space it took
is free again and no ``.tmp`` is left; a full disk is raised as one
:class:`~tandem.errors.CheckpointSaveError` naming the step, the folder and the newest checkpoint kept.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.errors import CheckpointSaveError
from tandem.files import remove_freeing

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
PREFIX = "global_step_"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class CheckpointManager:
    """Writes, finds and prunes checkpoints under ``root`` (see the module docstring)."""

    def __init__(self, root: str | Path, keep_last: int) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, state: dict[str, Any], save_engines: Callable[[Path], None]) -> Path:
        """Write checkpoint ``step``: ``save_engines(dir)`` writes the engines' states into ``dir``
        (``actor/``, ``critic/``), then ``state`` goes in as JSON, then the manifest."""
        final = self.root / f"{PREFIX}{step}"
        staging = self.root / f"{PREFIX}{step}.tmp"
        pointer = self.root / "latest.tmp"
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            save_engines(staging)
            (staging / STATE_FILE).write_text(json.dumps(state, indent=1))
            _write_manifest(staging)
            if final.exists():
                shutil.rmtree(final)
            staging.rename(final)
            pointer.write_text(final.name)
            os.replace(pointer, self.root / "latest")
        except BaseException as error:
            full = _disk_full(error) or _no_room(self.root)  # before the clean-up frees space
            remove_freeing(staging)  # frees what the failed save took
            pointer.unlink(missing_ok=True)
            if full:
                kept = self.latest()
                raise CheckpointSaveError(
                    f"checkpoint of step {step} not saved: no space left on the device of {self.root} "
                    f"({full}); "
                    + (f"{kept} and the earlier checkpoints are intact" if kept else "no checkpoint was kept")
                    + "; free space and resume"
                ) from error
            raise
        self._prune()
        return final

    def complete(self) -> list[Path]:
        """Finished checkpoints (renamed into place), oldest first; see :meth:`problem` for intact."""
        if not self.root.exists():
            return []
        found = [
            p
            for p in self.root.glob(f"{PREFIX}*")
            if p.is_dir()
            and not p.name.endswith(".tmp")
            and p.name.removeprefix(PREFIX).isdigit()
            and ((p / MANIFEST).exists() or (p / STATE_FILE).exists())
        ]
        return sorted(found, key=lambda p: int(p.name.removeprefix(PREFIX)))

    def latest(self) -> Path | None:
        """The newest finished checkpoint, or None."""
        found = self.complete()
        return found[-1] if found else None

    def resume_point(self, warn: Callable[[str], None]) -> Path | None:
        """The newest intact checkpoint (None: none is); each newer damaged one is named through ``warn``."""
        for path in reversed(self.complete()):
            problem = self.problem(path)
            if problem is None:
                return path
            warn(f"checkpoint {path} is damaged ({problem}); skipping it for an earlier one")
        return None

    @staticmethod
    def check_intact(path: str | Path) -> Path:
        """``path`` when it is an intact checkpoint; ``ValueError`` naming it and what is wrong otherwise."""
        path = Path(path)
        problem = CheckpointManager.problem(path)
        if problem is not None:
            raise ValueError(f"cannot resume from checkpoint {path}: {problem}")
        return path

    @staticmethod
    def problem(path: str | Path) -> str | None:
        """What makes checkpoint ``path`` unusable (a file of its manifest missing or of another
        size, an unreadable state), or None when it is intact. Reads sizes, not tensors."""
        path = Path(path)
        if not path.is_dir():
            return "no such checkpoint directory"
        if (path / MANIFEST).exists():
            try:
                files = json.loads((path / MANIFEST).read_text())["files"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                return f"{path / MANIFEST} is not readable ({type(error).__name__}: {error})"
            for name, size in files.items():
                file = path / name
                if not file.is_file():
                    return f"{file} is missing"
                if file.stat().st_size != size:
                    return f"{file} holds {file.stat().st_size} bytes where {size} were written (truncated?)"
        try:
            CheckpointManager.read_state(path)
        except (OSError, ValueError) as error:
            return str(error)
        return None

    @staticmethod
    def read_state(path: str | Path) -> dict[str, Any]:
        """The trainer's state saved in checkpoint ``path``; errors name the file."""
        file = Path(path) / STATE_FILE
        if not file.exists():
            raise FileNotFoundError(f"{path} is not a finished checkpoint (no {STATE_FILE})")
        try:
            state = json.loads(file.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{file} is not valid JSON ({error}); the checkpoint is damaged") from None
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError(f"{file} does not hold a trainer state (no 'step'); the checkpoint is damaged")
        return state

    def _prune(self) -> None:
        for old in self.complete()[: -self.keep_last] if self.keep_last else []:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(f"{PREFIX}*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)


def _write_manifest(directory: Path) -> None:
    """Record every file under ``directory`` with its size in ``manifest.json`` (written last)."""
    files = {
        str(file.relative_to(directory)): file.stat().st_size
        for file in sorted(directory.rglob("*"))
        if file.is_file()
    }
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def _disk_full(error: BaseException) -> str | None:
    """The disk-full message in ``error`` or its causes (a worker's error may carry it only as
    text: Ray, spawned processes and DCP wrap it), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            return os.strerror(error.errno)
        for code in DISK_FULL:
            if os.strerror(code) in str(error):
                return os.strerror(code)
        error = error.__cause__ or error.__context__
    return None


def _no_room(folder: Path, below: int = 1 << 20) -> str | None:
    """A message when ``folder``'s file system has under ``below`` bytes free (None otherwise).
    torch's zip writer reports a full disk only as ``unexpected pos``, so the space is looked at."""
    try:
        stats = os.statvfs(folder)
    except OSError:
        return None
    free = stats.f_bavail * stats.f_frsize
    return f"{free} bytes free after the failed write" if free < below else None
