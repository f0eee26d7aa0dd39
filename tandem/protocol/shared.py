"""A :class:`Batch` handed to another process on the same host through a shared-memory file.

Pickling a batch for a pipe or Ray's object store copies its tensors at least twice (into
the message, out of it). :func:`share_batch` writes the batch once, in the
:func:`~tandem.protocol.to_bytes` layout, into a file in a memory-backed directory
(``/dev/shm``) and returns a :class:`SharedBatch` — a path and a size, which is all that
travels. :meth:`SharedBatch.open` in the receiving process maps the file and rebuilds the
batch with tensors that are views of the mapping (no copy), then deletes the name: the pages
live as long as the views do.

Only a process that sees the same directory can open it; :func:`write_probe` and
:func:`read_probe` let a sender find out first (a worker on another host, or in a container
with its own ``/dev/shm``, cannot).
"""

from __future__ import annotations

import itertools
import os
import secrets
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.protocol.batch import Batch
from tandem.protocol.serialize import ALIGN, from_bytes, to_buffers

PREFIX = "tandem-batch"
PROBE_PREFIX = "tandem-probe"
HEADROOM_BYTES = 64 << 20  # leave this much of the directory free; a full tmpfs kills the writer with SIGBUS


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class SharedBatch:
    """A batch written to ``path`` (``nbytes`` bytes): pickle this instead of the batch."""

    path: str
    nbytes: int

    def open(self) -> Batch:
        """The batch, its tensors views of the mapped file; the file's name is removed (once)."""
        if not os.path.exists(self.path):
            raise FileNotFoundError(
                f"shared batch {self.path} is gone: opened twice, or its sender cleaned up "
                "(is this process on the sender's host?)"
            )
        mapped = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)
        Path(self.path).unlink(missing_ok=True)
        return from_bytes(memoryview(mapped.numpy()))


def batch_nbytes(batch: Batch) -> int:
    """Bytes of the batch's tensor payloads."""
    return sum(t.numel() * t.element_size() for t in batch.tensors.values())


class BatchSharer:
    """Writes batches as ``<directory>/tandem-batch-<pid>-<id>-<n>`` files for one sender.

    ``min_bytes``: smaller batches are not worth a file (:meth:`share` returns them as they are).
    """

    def __init__(self, directory: str = "/dev/shm", min_bytes: int = 256 << 10) -> None:
        self.directory = Path(directory)
        self.min_bytes = min_bytes
        self.prefix = f"{PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._serial = itertools.count()
        self.files_written = 0

    def share(self, batch: Batch) -> SharedBatch | Batch:
        """``batch`` as a :class:`SharedBatch`; the batch itself when it is small or the directory
        lacks room (then it travels by pickle, as it would without sharing)."""
        if batch_nbytes(batch) < self.min_bytes:
            return batch
        header, buffers = to_buffers(batch)
        start = _aligned(len(header))
        offsets, offset = [], 0
        for buffer in buffers:
            offsets.append(offset)
            offset = _aligned(offset + buffer.nbytes)
        nbytes = start + offsets[-1] + buffers[-1].nbytes
        if not self._has_room(nbytes):
            return batch
        path = self.directory / f"{self.prefix}-{next(self._serial)}"
        out = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        out[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        for begin, buffer in zip(offsets, buffers, strict=True):
            if buffer.nbytes:
                at = start + begin
                source = bytearray(buffer) if buffer.readonly else buffer  # the small pickle of objects
                out[at : at + buffer.nbytes].copy_(torch.frombuffer(source, dtype=torch.uint8))
        self.files_written += 1
        return SharedBatch(str(path), nbytes)

    def _has_room(self, nbytes: int) -> bool:
        try:
            stats = os.statvfs(self.directory)
        except OSError:
            return False
        return stats.f_bavail * stats.f_frsize >= nbytes + HEADROOM_BYTES

    def discard_all(self) -> int:
        """Delete the files this sharer wrote that nobody opened (a receiver died); returns how many."""
        paths = list(self.directory.glob(f"{self.prefix}-*"))
        for path in paths:
            path.unlink(missing_ok=True)
        return len(paths)


def write_probe(directory: str = "/dev/shm") -> tuple[str, str]:
    """A file holding a random token in ``directory``: ``(path, token)``; delete it when done."""
    token = secrets.token_hex(16)
    path = Path(directory) / f"{PROBE_PREFIX}-{os.getpid()}-{token[:8]}"
    path.write_text(token)
    return str(path), token


def read_probe(path: str, token: str) -> bool:
    """Whether this process sees the probe file ``path`` with ``token`` in it (the same host and
    memory-backed directory as its writer)."""
    try:
        return Path(path).read_text() == token
    except OSError:
        return False
