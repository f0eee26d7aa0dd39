"""A function program's prints, kept per episode: what it writes to ``sys.stdout`` and
``sys.stderr`` while its episode runs goes to that episode's buffers, not to the run's log.

Many episodes run at once on one event loop, so redirecting the process's streams would mix
them. Instead, while any episode is capturing, ``sys.stdout``/``sys.stderr`` are proxies that
look up the current episode in a context variable (each episode runs as its own task, and a task
runs in a copy of its creator's context), write to its buffer, and pass every other write on to
the stream they replaced. Each buffer keeps the first ``limit`` bytes (encoded as UTF-8), then a
note of how many more were dropped: unlike a command's flood, too much output is no fault.

Not captured: writes straight to the file descriptors (``os.write(1, ...)``, C extensions),
writes from threads the program starts (a new thread starts with an empty context), and a
program that replaces ``sys.stdout`` itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

_CURRENT: contextvars.ContextVar[EpisodeOutput | None] = contextvars.ContextVar(
    "tandem_program_output", default=None
)
_LOCK = threading.Lock()
_USERS = 0  # episodes capturing now; the proxies are installed while it is above 0


class _Capped:
    """The first ``limit`` bytes written, and a count of the bytes dropped after them."""

    def __init__(self, limit: int) -> None:
        self.limit, self.kept, self.dropped = limit, bytearray(), 0

    def write(self, text: str) -> None:
        data = text.encode("utf-8", "replace")
        room = max(0, self.limit - len(self.kept))
        self.kept += data[:room]
        self.dropped += max(0, len(data) - room)

    def text(self) -> str:
        kept = self.kept.decode("utf-8", "replace")
        return kept + (f"\n[... {self.dropped} more bytes not kept]" if self.dropped else "")


class EpisodeOutput:
    """One episode's captured ``stdout`` and ``stderr``, each capped at ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.streams = {"stdout": _Capped(limit), "stderr": _Capped(limit)}

    def texts(self) -> dict[str, str]:
        """``{"stdout": ..., "stderr": ...}`` as kept (the form of a command's output)."""
        return {name: stream.text() for name, stream in self.streams.items()}


class _EpisodeStream:
    """A stand-in for ``sys.<name>``: writes of a capturing episode go to its buffer, the rest to
    ``original``; every other attribute is ``original``'s."""

    def __init__(self, name: str, original: TextIO) -> None:
        self._name, self._original = name, original

    def write(self, text: str) -> int:
        output = _CURRENT.get()
        if output is None:
            return self._original.write(text)
        output.streams[self._name].write(text)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if _CURRENT.get() is None:
            self._original.flush()

    def __getattr__(self, name: str):
        return getattr(self._original, name)


@contextlib.contextmanager
def captured_output(limit: int) -> Iterator[EpisodeOutput]:
    """Within the block (and the tasks it creates), this context's prints go to the returned
    buffers (see the module docstring)."""
    output = EpisodeOutput(limit)
    _install()
    token = _CURRENT.set(output)
    try:
        yield output
    finally:
        _CURRENT.reset(token)
        _uninstall()


def _install() -> None:
    global _USERS
    with _LOCK:
        _USERS += 1
        for name in ("stdout", "stderr"):
            if not isinstance(getattr(sys, name), _EpisodeStream):
                setattr(sys, name, _EpisodeStream(name, getattr(sys, name)))


def _uninstall() -> None:
    global _USERS
    with _LOCK:
        _USERS -= 1
        if _USERS:
            return
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if isinstance(stream, _EpisodeStream):  # else someone replaced it since: leave theirs
                setattr(sys, name, stream._original)
