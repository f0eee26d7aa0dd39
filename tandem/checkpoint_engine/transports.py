"""How a bucket's bytes travel: a broadcast group, shared-memory slots, or files.

Each transport has a sender half (a buffer to pack slot ``s`` into, ``post`` to send it,
``reclaim`` before the slot is reused) and a receiver half (``take`` a bucket's bytes as a
uint8 tensor). Flow-controlled transports need the receivers' acknowledgements before a slot
is reused; the broadcast group is its own flow control.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.checkpoint_engine.buckets import BucketMeta
from tandem.controller.network import rendezvous_host, route_collectives_through

SLOTS = 2  # a bucket is packed while the previous one is in flight


SLOT_PREFIX = "tandem-weights"  # slot and bucket files: <prefix>-<sender pid>-<random>-...


def _grown(buffer: torch.Tensor | None, nbytes: int, device: torch.device) -> torch.Tensor:
    if buffer is not None and buffer.numel() >= nbytes:
        return buffer
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


# ---------------------------------------------------------------------- broadcast
def broadcast_group(
    store: dist.Store, rank: int, size: int, backend: str, timeout_s: float
) -> dist.ProcessGroup:
    """A process group of its own (rank 0 the sender): it does not touch the default group of
    either side, so trainer ranks and rollout replicas keep their own collectives."""
    prefixed = dist.PrefixStore("weight-broadcast", store)
    route_collectives_through(rendezvous_host())
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, size)
    return dist.ProcessGroupGloo(prefixed, rank, size, datetime.timedelta(seconds=timeout_s))


class BroadcastSender:
    flow_controlled = False

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device
        self.buffers: list[torch.Tensor | None] = [None] * SLOTS
        self.works: list = [None] * SLOTS

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """Slot ``slot``'s buffer; the sender reclaimed the slot (its broadcast finished) before asking."""
        self.buffers[slot] = _grown(self.buffers[slot], nbytes, self.device)
        return self.buffers[slot]

    def post(self, slot: int, meta: BucketMeta, version: int) -> BucketMeta:
        self.works[slot] = self.group.broadcast(self.buffers[slot][: meta.nbytes], 0)
        return meta

    def reclaim(self, slot: int, meta: BucketMeta | None) -> None:
        if self.works[slot] is not None:
            self.works[slot].wait()
            self.works[slot] = None

    def close(self) -> None:
        for slot in range(SLOTS):
            self.reclaim(slot, None)


class BroadcastReceiver:
    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device
        self.buffer: torch.Tensor | None = None

    def take(self, meta: BucketMeta) -> torch.Tensor:
        self.buffer = _grown(self.buffer, meta.nbytes, self.device)
        received = self.buffer[: meta.nbytes]
        self.group.broadcast(received, 0).wait()
        return received

    def close(self) -> None:
        self.buffer = None


# ---------------------------------------------------------------------- shared memory
class SharedMemorySender:
    """Two slot files in a memory-backed directory, mapped shared: packing writes straight into
    the memory the replicas map (no copy in between)."""

    flow_controlled = True

    def __init__(self, directory: str, bucket_bytes: int) -> None:
        self.directory = Path(directory or "/dev/shm")
        if not self.directory.is_dir():
            raise ValueError(
                f"checkpoint_engine.directory={self.directory} is not a directory (shared_memory)"
            )
        free = shutil.disk_usage(self.directory).free
        if free < SLOTS * bucket_bytes:
            raise ValueError(
                f"checkpoint_engine: {self.directory} has {free / 2**20:.0f} MiB free, and shared_memory needs "
                f"{SLOTS} buckets of {bucket_bytes / 2**20:.0f} MiB; lower checkpoint_engine.bucket_mb or use "
                "backend=files"
            )
        self.bucket_bytes = bucket_bytes
        self.prefix = f"{SLOT_PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.maps: list[torch.Tensor | None] = [None] * SLOTS
        self.paths: list[Path | None] = [None] * SLOTS
        self._files = 0

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        current = self.maps[slot]
        if current is None or current.numel() < nbytes:  # a tensor larger than a bucket: a larger slot file
            self._unlink(slot)
            self._files += 1
            path = self.directory / f"{self.prefix}-{self._files}"
            self.maps[slot] = torch.from_file(
                str(path), shared=True, size=max(nbytes, self.bucket_bytes), dtype=torch.uint8
            )
            self.paths[slot] = path
        return self.maps[slot]

    def post(self, slot: int, meta: BucketMeta, version: int) -> BucketMeta:
        return dataclasses.replace(meta, location=str(self.paths[slot]))

    def reclaim(self, slot: int, meta: BucketMeta | None) -> None:
        pass  # the receivers' acknowledgements are all a slot needs

    def _unlink(self, slot: int) -> None:
        if self.paths[slot] is not None:
            self.paths[slot].unlink(missing_ok=True)  # receivers that still map it keep their pages
        self.maps[slot] = self.paths[slot] = None

    def close(self) -> None:
        for slot in range(SLOTS):
            self._unlink(slot)


class SharedMemoryReceiver:
    def __init__(self) -> None:
        self.maps: dict[str, torch.Tensor] = {}

    def take(self, meta: BucketMeta) -> torch.Tensor:
        mapped = self.maps.get(meta.location)
        if mapped is None:
            size = os.path.getsize(meta.location)
            mapped = torch.from_file(meta.location, shared=True, size=size, dtype=torch.uint8)
            self.maps[meta.location] = mapped
            while len(self.maps) > SLOTS:  # the sender replaced a slot file: let the old mapping go
                self.maps.pop(next(iter(self.maps)))
        return mapped[: meta.nbytes]

    def close(self) -> None:
        self.maps.clear()


# ---------------------------------------------------------------------- files
class FileSender:
    """One file per bucket, written then renamed into place; deleted once every replica read it."""

    flow_controlled = True

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.prefix = f"{SLOT_PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.buffers: list[torch.Tensor | None] = [None] * SLOTS
        self.written: set[Path] = set()

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        self.buffers[slot] = _grown(self.buffers[slot], nbytes, torch.device("cpu"))
        return self.buffers[slot]

    def post(self, slot: int, meta: BucketMeta, version: int) -> BucketMeta:
        path = self.directory / f"{self.prefix}-v{version}-b{meta.index}"
        staging = path.with_name(path.name + ".tmp")
        with open(staging, "wb") as handle:
            handle.write(memoryview(self.buffers[slot][: meta.nbytes].numpy()))
        os.replace(staging, path)
        self.written.add(path)
        return dataclasses.replace(meta, location=str(path))

    def reclaim(self, slot: int, meta: BucketMeta | None) -> None:
        if meta is not None and meta.location:
            Path(meta.location).unlink(missing_ok=True)
            self.written.discard(Path(meta.location))

    def close(self) -> None:
        for path in self.written:
            path.unlink(missing_ok=True)
        self.written.clear()


class FileReceiver:
    def take(self, meta: BucketMeta) -> torch.Tensor:
        return torch.from_file(meta.location, shared=False, size=meta.nbytes, dtype=torch.uint8)

    def close(self) -> None:
        pass
