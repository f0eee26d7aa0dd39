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
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.checkpoint_engine.buckets import ALIGN, BucketMeta, TensorSpec, layout, pack, unpack

PREFIX = "tandem-samples"


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


class InlineWriter:
    """A :class:`SampleWriter` for a producer on another host: entries carry their tensors."""

    def write(self, key: str, tensors: dict[str, torch.Tensor]) -> InlineSample:
        return InlineSample({name: t.detach().contiguous() for name, t in tensors.items()})

    def discard_all(self) -> None:
        """Nothing is stored outside the entries."""


class SampleWriter:
    """Writes entries as files named ``tandem-samples-<pid>-<random>-<key>`` under ``directory``."""

    def __init__(self, directory: str = "/dev/shm") -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"sample store: {self.directory} is not a directory")
        self.prefix = f"{PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def write(self, key: str, tensors: dict[str, torch.Tensor]) -> SampleRef:
        """Pack ``tensors`` (CPU) into a new file for ``key``; returns its reference."""
        group = [(name, t.detach().contiguous()) for name, t in tensors.items()]
        specs, nbytes = layout(group)
        path = self.directory / f"{self.prefix}-{key}"
        buffer = torch.from_file(str(path), shared=True, size=max(nbytes, ALIGN), dtype=torch.uint8)
        pack(buffer, group, specs)
        return SampleRef(str(path), nbytes, specs)

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


def release(ref: SampleRef | InlineSample) -> None:
    """Delete the entry's file (mappings already made stay valid until dropped); nothing for an
    inline entry."""
    if isinstance(ref, SampleRef):
        Path(ref.path).unlink(missing_ok=True)
