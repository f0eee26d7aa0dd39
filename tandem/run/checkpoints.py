"""Trainer checkpoints, for every trainer: ``<output_dir>/checkpoints/global_step_<k>/`` with the
engines' states (the RL trainer's ``actor/`` and ``critic/``, the SFT-family trainers' ``engine/``:
model, optimizer, scheduler, RNG) and ``trainer_state.json`` (step, sampler, KL controller, ...).

A checkpoint is assembled in ``global_step_<k>.tmp`` and renamed into place only when complete,
then the ``latest`` pointer is replaced atomically: a crash at any point leaves the previous
checkpoint usable, and resume ignores a half-written one. Only the newest ``keep_last`` stay
(``0``: every one).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
PREFIX = "global_step_"


class CheckpointManager:
    """Writes, finds and prunes checkpoints under ``root`` (see the module docstring)."""

    def __init__(self, root: str | Path, keep_last: int) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, state: dict[str, Any], save_engines: Callable[[Path], None]) -> Path:
        """Write checkpoint ``step``: ``save_engines(dir)`` writes the engines' states into ``dir``
        (``actor/``, ``critic/``), then ``state`` goes in as JSON."""
        final = self.root / f"{PREFIX}{step}"
        staging = self.root / f"{PREFIX}{step}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        save_engines(staging)
        (staging / STATE_FILE).write_text(json.dumps(state, indent=1))
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        pointer = self.root / "latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, self.root / "latest")
        self._prune()
        return final

    def complete(self) -> list[Path]:
        """Finished checkpoints, oldest first."""
        if not self.root.exists():
            return []
        found = [
            p
            for p in self.root.glob(f"{PREFIX}*")
            if p.is_dir() and not p.name.endswith(".tmp") and (p / STATE_FILE).exists()
        ]
        return sorted(found, key=lambda p: int(p.name.removeprefix(PREFIX)))

    def latest(self) -> Path | None:
        """The newest finished checkpoint, or None."""
        found = self.complete()
        return found[-1] if found else None

    @staticmethod
    def read_state(path: str | Path) -> dict[str, Any]:
        path = Path(path)
        if not (path / STATE_FILE).exists():
            raise FileNotFoundError(f"{path} is not a finished checkpoint (no {STATE_FILE})")
        return json.loads((path / STATE_FILE).read_text())

    def _prune(self) -> None:
        for old in self.complete()[: -self.keep_last] if self.keep_last else []:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(f"{PREFIX}*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
