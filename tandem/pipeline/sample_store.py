"""Where finished samples' tensors live until a consumer pulls them: files in shared memory.

The producer (a rollout replica) packs a prompt group's tensors into one file in a
memory-backed directory (``/dev/shm``) with the checkpoint engine's bucket layout and hands on
only a :class:`SampleRef` — the file and each field's dtype, shape and offset. A consumer on
the same host maps the file and gets views of the fields it asks for: no pickling, no copy
(the views share the producer's pages). :func:`release` deletes the file once consumed.

A producer on another host (or in a container with its own ``/dev/shm``) cannot hand over a
file; :class:`InlineWriter` keeps its tensors in the entry itself (:class:`InlineSample`), which
then travels with the metadata — through the process pipe, or Ray's object store across
hosts. Consumers read either kind with :func:`read_fields`.

A file's pages are reserved (``posix_fallocate``) before it is mapped, so a full directory is a
:class:`SampleStoreFullError` naming it, the bytes asked and the bytes free, never a SIGBUS
when a page of the mapping is first written.
"""

from __future__ import annotations

import errno
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.checkpoint_engine.buckets import ALIGN, BucketMeta, TensorSpec, layout, pack, unpack
from tandem.dataplane import BatchRef
from tandem.dataplane import release as release_block

PREFIX = "tandem-samples"


class SampleStoreFullError(OSError):
    """The sample directory has no room for a prompt group's file (see :meth:`SampleWriter.write`)."""


@dataclass(frozen=True)
class SampleRef:
    """One stored entry: ``path`` holds ``nbytes`` bytes laid out as ``fields``."""

    path: str
    nbytes: int
    fields: tuple[TensorSpec, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.fields)


@dataclass(frozen=True)
class InlineSample:
    """One entry whose tensors travel with it (the producer cannot share files with the consumer)."""

    tensors: dict[str, torch.Tensor]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.tensors)

    @property
    def nbytes(self) -> int:
        """The bytes of its tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class InlineWriter:
    """A :class:`SampleWriter` for a producer on another host: entries carry their tensors."""

    needs_prompt = False  # an entry holds the responses; the consumer has the prompts

    def write(self, key: str, tensors: dict[str, torch.Tensor]) -> InlineSample:
        return InlineSample({name: t.detach().contiguous() for name, t in tensors.items()})

    def size_of(self, tensors: dict[str, torch.Tensor]) -> int:
        """The bytes :meth:`write` would hold for ``tensors``."""
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def discard_all(self) -> None:
        """Nothing is stored outside the entries."""


class SampleWriter:
    """Writes entries as files named ``tandem-samples-<pid>-<random>-<key>`` under ``directory``."""

    needs_prompt = False  # an entry holds the responses; the consumer has the prompts

    def __init__(self, directory: str = "/dev/shm") -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"sample store: {self.directory} is not a directory")
        self.prefix = f"{PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def write(self, key: str, tensors: dict[str, torch.Tensor]) -> SampleRef:
        """Pack ``tensors`` (CPU) into a new file for ``key``; returns its reference.

        The file's pages are reserved first: a directory without room for them raises
        :class:`SampleStoreFullError` (and leaves no file)."""
        group = [(name, t.detach().contiguous()) for name, t in tensors.items()]
        specs, nbytes = layout(group)
        path = self.directory / f"{self.prefix}-{key}"
        self._reserve(path, max(nbytes, ALIGN))
        buffer = torch.from_file(str(path), shared=True, size=max(nbytes, ALIGN), dtype=torch.uint8)
        pack(buffer, group, specs)
        return SampleRef(str(path), nbytes, specs)

    def size_of(self, tensors: dict[str, torch.Tensor]) -> int:
        """The bytes :meth:`write` would store for ``tensors``."""
        return max(layout([(name, t) for name, t in tensors.items()])[1], ALIGN)

    def _reserve(self, path: Path, size: int) -> None:
        """Create ``path`` with ``size`` bytes of pages allocated (a tmpfs maps them lazily and
        kills the writer with SIGBUS when it has none left to give)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            path.unlink(missing_ok=True)
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            stats = os.statvfs(self.directory)
            raise SampleStoreFullError(
                error.errno,
                f"sample store: {self.directory} is full: a prompt group's samples need {size:,} bytes "
                f"and {stats.f_bavail * stats.f_frsize:,} bytes are free there. Free or enlarge "
                f"{self.directory}, lower pipeline.max_inflight_bytes, or set pipeline.sample_store=inline "
                "(the samples then travel with their metadata)",
            ) from None
        finally:
            os.close(fd)

    def discard_all(self) -> None:
        """Delete every file this writer made that is still there (shutdown)."""
        for path in self.directory.glob(f"{self.prefix}-*"):
            path.unlink(missing_ok=True)


def discard_files_of(pid: int, directory: str = "/dev/shm", prefix: str = PREFIX) -> int:
    """Delete the files named ``<prefix>-<pid>-*`` (a process that could not clean up); returns how many."""
    paths = list(Path(directory).glob(f"{prefix}-{pid}-*"))
    for path in paths:
        path.unlink(missing_ok=True)
    return len(paths)


def inflight_bound(max_inflight_bytes: int, directory: str) -> int:
    """The byte bound on samples waiting for the trainer: ``pipeline.max_inflight_bytes``, or
    with 0 half the free space of ``directory`` now (the rest stays for the weight buckets, the
    data plane's blocks and the step being assembled)."""
    if max_inflight_bytes:
        return max_inflight_bytes
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize // 2


def stored_nbytes(ref: SampleRef | InlineSample | BatchRef) -> int:
    """The bytes an entry holds while it waits: its file's, its inline tensors', or its data-plane
    blocks' (files in shared memory: :mod:`tandem.pipeline.group_blocks`)."""
    if isinstance(ref, BatchRef):
        return sum(block.nbytes for block in ref.blocks())  # type: ignore[attr-defined]
    return max(ref.nbytes, ALIGN) if isinstance(ref, SampleRef) else ref.nbytes


def read_fields(
    ref: SampleRef | InlineSample, names: tuple[str, ...] | None = None
) -> dict[str, torch.Tensor]:
    """Views of ``names`` (default: all fields) in the mapped file (they share its memory), or
    an inline entry's own tensors."""
    wanted = set(ref.names if names is None else names)
    missing = sorted(wanted - set(ref.names))
    if missing:
        where = ref.path if isinstance(ref, SampleRef) else "(inline)"
        raise KeyError(f"sample {where} has no fields {missing} (it has {list(ref.names)})")
    if isinstance(ref, InlineSample):
        return {name: ref.tensors[name] for name in ref.names if name in wanted}
    if not os.path.exists(ref.path):
        raise FileNotFoundError(f"sample {ref.path} is gone (released twice, or its producer cleaned up)")
    size = max(ref.nbytes, ALIGN)
    buffer = torch.from_file(ref.path, shared=True, size=size, dtype=torch.uint8)
    specs = tuple(spec for spec in ref.fields if spec.name in wanted)
    return dict(unpack(buffer, BucketMeta(0, ref.nbytes, specs)))


def release(ref: SampleRef | InlineSample | BatchRef) -> None:
    """Delete the entry's file (mappings already made stay valid until dropped) or its data-plane
    blocks; nothing for an inline entry."""
    if isinstance(ref, BatchRef):
        ref.release(release_block)
    elif isinstance(ref, SampleRef):
        Path(ref.path).unlink(missing_ok=True)
