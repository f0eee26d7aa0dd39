"""A run's output directory: checked before anything loads and held by one run at a time.

Two runs writing one ``output_dir`` would interleave ``metrics.jsonl`` lines and prune each
other's checkpoints. :class:`OutputDirLock` takes an exclusive ``flock`` on
``<output_dir>/.lock`` for the run's lifetime; the kernel drops it when the process exits, even
on ``kill -9``, so a crashed run never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from tandem.errors import OutputDirInUseError

LOCK_FILE = ".lock"


def check_output_dir(path: str | os.PathLike, field: str) -> Path:
    """``path`` as a Path; raises ``ValueError`` naming ``field`` when something other than a
    directory is in the way (the directory itself need not exist yet)."""
    path = Path(path)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                what = "the file" if part == path else f"its parent {part}, a file"
                raise ValueError(f"{field}={path}: {what} is in the way; name a directory")
            break
    return path


class OutputDirLock:
    """Holds ``<path>/.lock`` exclusively while in use; a second run is refused, naming the first one's pid."""

    def __init__(self, path: str | os.PathLike, field: str) -> None:
        self.path = check_output_dir(path, field)
        self.field = field
        self._file = None

    def __enter__(self) -> OutputDirLock:
        self.path.mkdir(parents=True, exist_ok=True)
        handle = open(self.path / LOCK_FILE, "a+")  # noqa: SIM115 (held open for the run's lifetime)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise OutputDirInUseError(
                f"{self.field}={self.path} is in use by another run (pid {holder}); "
                "wait for it to finish or choose another output directory"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._file = handle
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor releases the flock
            self._file = None
