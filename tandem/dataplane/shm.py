"""The one-host engine: each block is one file in a memory-backed directory (``/dev/shm``).

The file holds the block's arrays (:mod:`tandem.dataplane.columns`) back to back, each
starting on a 4 KiB page, and nothing else: the layout travels in the :class:`ShmBlock`
reference. A reader on the same host maps the file (read-only) and decodes the rows and fields
it asked for straight from the mapping into the padded tensors it returns, in one pass per
field (:func:`~tandem.dataplane.columns.decode_field`): it reads only those rows' bytes, and no
intermediate copy is made. (Reading the rows first with ``preadv`` into compact tensors, then
decoding those the same way, took ~1.3x as long at 128 rows x 4096 tokens: one more copy.)
A process that does not see the directory (another host, a container with its own
``/dev/shm``) cannot read the block: across hosts use the Ray engine.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.dataplane.columns import StoredArrays, UnpaddedField, WireColumn, encode
from tandem.dataplane.store import check_fields, check_rows, count, decode_rows
from tandem.dataplane.windows import numpy_dtype

PREFIX = "tandem-block"
PAGE = 4096
HEADROOM_BYTES = 64 << 20  # a full tmpfs kills the writer with SIGBUS; refuse before that


@dataclass(frozen=True)
class ArrayPlace:
    """Where one array lies in a block file: byte offset, dtype (torch name) and shape."""

    name: str
    offset: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShmBlock:
    """A block stored as ``path``: ``rows`` rows of ``columns``, its arrays at ``places``."""

    path: str
    rows: int
    columns: tuple[WireColumn, ...]
    places: tuple[ArrayPlace, ...]
    nbytes: int
    engine: str = "shm"


def _pages(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


class ShmStore:
    """Writes blocks as ``<directory>/tandem-block-<pid>-<id>-<n>`` and reads any such block."""

    def __init__(self, directory: str = "/dev/shm") -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"dataplane.directory: {self.directory} is not a directory")
        self.prefix = f"{PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._serial = itertools.count()

    def put(self, tensors: Mapping[str, torch.Tensor | UnpaddedField]) -> ShmBlock:
        """Encode ``tensors`` (each ``[N, ...]``, one ``N``) and write them to a new file."""
        rows = _rows_of(tensors)
        columns, arrays = encode(tensors)
        places, offset = [], 0
        for name, array in arrays.items():
            places.append(
                ArrayPlace(name, offset, str(array.dtype).removeprefix("torch."), tuple(array.shape))
            )
            offset = _pages(offset + array.numel() * array.element_size())
        self._check_room(offset)
        path = self.directory / f"{self.prefix}-{next(self._serial)}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, offset)
            for place, array in zip(places, arrays.values(), strict=True):
                if array.numel():
                    os.pwritev(fd, [_bytes_of(array)], place.offset)
        finally:
            os.close(fd)
        count(put=sum(a.numel() * a.element_size() for a in arrays.values()), blocks_put=1)
        return ShmBlock(str(path), rows, columns, tuple(places), offset)

    def get(self, block: ShmBlock, fields: Sequence[str], rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """Padded ``[len(rows), ...]`` tensors of ``fields``; ``rows`` sorted and unique."""
        check_fields(block, fields)
        wanted = check_rows(block, rows)
        with _mapped(block) as arrays:
            return decode_rows(block.columns, arrays, wanted, fields)

    def release(self, block: ShmBlock) -> None:
        """Delete the block's file (readers with it open finish their reads)."""
        path = Path(block.path)
        if path.exists():
            path.unlink(missing_ok=True)
            count(released=1)

    def discard_all(self) -> int:
        """Delete every block this store wrote that is still there (shutdown); returns how many."""
        paths = list(self.directory.glob(f"{self.prefix}-*"))
        for path in paths:
            path.unlink(missing_ok=True)
        return len(paths)

    def _check_room(self, nbytes: int) -> None:
        stats = os.statvfs(self.directory)
        free = stats.f_bavail * stats.f_frsize
        if free < nbytes + HEADROOM_BYTES:
            raise OSError(
                f"dataplane: {self.directory} has {free >> 20} MiB free, a block needs {nbytes >> 20} MiB "
                f"(+{HEADROOM_BYTES >> 20} MiB headroom); free it, enlarge it, or set dataplane.engine=ray"
            )


def discard_blocks_of(pid: int, directory: str = "/dev/shm") -> int:
    """Delete the block files process ``pid`` wrote in ``directory`` (it ended without releasing
    them); returns how many."""
    paths = list(Path(directory).glob(f"{PREFIX}-{pid}-*"))
    for path in paths:
        path.unlink(missing_ok=True)
    return len(paths)


def _rows_of(tensors: Mapping[str, torch.Tensor | UnpaddedField]) -> int:
    sizes = {name: t.shape[0] for name, t in tensors.items()}
    if not sizes or len(set(sizes.values())) != 1:
        raise ValueError(f"a block's fields need one row count, got {sizes}")
    return next(iter(sizes.values()))


def _bytes_of(array: torch.Tensor) -> memoryview:
    return memoryview(array.contiguous().reshape(-1).view(torch.uint8).numpy())


@contextlib.contextmanager
def _mapped(block: ShmBlock) -> Iterator[StoredArrays]:
    """The block's arrays as numpy views of a read-only map of its file, unmapped on exit."""
    try:
        fd = os.open(block.path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"block {block.path} is gone: released, or this process is not on its writer's host "
            "(across hosts use dataplane.engine=ray)"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size < block.nbytes:  # reading a page past the end of a map is a SIGBUS, not an error
            raise OSError(f"block {block.path} holds {size} bytes, its reference says {block.nbytes}")
        mapping = mmap.mmap(fd, block.nbytes, prot=mmap.PROT_READ) if block.nbytes else None
    finally:
        os.close(fd)
    arrays = {p.name: _view(mapping, p) for p in block.places}
    try:
        yield arrays
    finally:
        arrays.clear()
        if mapping is not None:
            with contextlib.suppress(BufferError):  # a view still held (by a traceback): unmapped with it
                mapping.close()


def _view(mapping: mmap.mmap | None, place: ArrayPlace) -> np.ndarray:
    dtype = numpy_dtype(getattr(torch, place.dtype))
    elements = int(np.prod(place.shape))
    if elements == 0 or mapping is None:
        return np.empty(place.shape, dtype=dtype)
    return np.frombuffer(mapping, dtype=dtype, count=elements, offset=place.offset).reshape(place.shape)
