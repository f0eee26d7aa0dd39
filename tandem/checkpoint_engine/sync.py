"""``WeightSender`` / ``WeightReceiver``: one weight version from a trainer to rollout replicas.

The sender (trainer rank 0) takes ``(name, tensor)`` pairs one at a time — under FSDP2 every
trainer rank iterates ``iter_parameters`` in step and only rank 0 sends — packs them into
buckets (:mod:`.buckets`), hands each bucket to the transport (:mod:`.transports`) and
publishes its meta on the control plane (:mod:`.control`). Two slots are in flight, so the
next bucket is gathered and packed while the previous one travels. Receivers yield the
tensors as views of each bucket; the rollout engine copies them into its model as it
iterates (``engine.update_weights(receiver.receive(version), version)``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from tandem.checkpoint_engine.buckets import BucketMeta, group_tensors, layout, pack, unpack
from tandem.checkpoint_engine.config import CheckpointEngineConfig
from tandem.checkpoint_engine.control import ControlPlane
from tandem.checkpoint_engine.transports import (
    SLOTS,
    BroadcastReceiver,
    BroadcastSender,
    FileReceiver,
    FileSender,
    SharedMemoryReceiver,
    SharedMemorySender,
    broadcast_group,
)
from tandem.controller.network import rendezvous_host


@dataclass(frozen=True)
class SenderAddress:
    """What a receiver needs to join: the control plane's address, the backend, and the group size."""

    host: str
    port: int
    backend: str
    receivers: int
    group_backend: str  # gloo or nccl, for the broadcast backend


@dataclass(frozen=True)
class SyncStats:
    """One sync as the sender saw it."""

    version: int
    seconds: float
    bytes: int
    buckets: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / max(self.seconds, 1e-9)


class WeightSender:
    """The trainer side (see the module docstring). ``receivers`` replicas will connect.

    Call :meth:`connect` while every receiver constructs its :class:`WeightReceiver` (the
    broadcast backend forms its group then; the others return at once).
    """

    def __init__(self, config: CheckpointEngineConfig, receivers: int, device: torch.device) -> None:
        if config.backend == "naive":
            raise ValueError(
                "checkpoint_engine.backend=naive copies into a rollout engine in the same process; "
                "replicas in other processes need broadcast, shared_memory or files"
            )
        self.config, self.receivers, self.device = config, receivers, device
        # The store binds a free port itself: picking one first and binding it later races with
        # every other process on the machine (EADDRINUSE).
        host = config.host or rendezvous_host()
        self.control = ControlPlane(host, 0, is_sender=True, timeout_s=config.timeout_s)
        group_backend = "nccl" if device.type == "cuda" else "gloo"
        self.address = SenderAddress(host, self.control.port, config.backend, receivers, group_backend)
        self.transport = None
        self._in_flight: list[BucketMeta | None] = [None] * SLOTS  # posted, not yet read by every receiver
        self._in_flight_version = 0

    def connect(self) -> None:
        config = self.config
        if config.backend == "broadcast":
            group = broadcast_group(
                self.control.store, 0, self.receivers + 1, self.address.group_backend, config.timeout_s
            )
            self.transport = BroadcastSender(group, self.device)
        elif config.backend == "shared_memory":
            self.transport = SharedMemorySender(config.directory, config.bucket_bytes)
        else:
            self.transport = FileSender(config.directory)

    def send(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, wait_for_receivers: bool = True
    ) -> SyncStats:
        """Send every tensor as weight ``version``; returns when every receiver has the bytes.

        ``wait_for_receivers=False`` returns once the last bucket is posted: the receivers read
        while the caller goes on (the tensors are already copied into the buckets), and the next
        send, or :meth:`settle`, first waits for them. The broadcast backend always waits (a
        broadcast returns when every receiver has taken part).
        """
        if self.transport is None:
            raise RuntimeError("WeightSender.connect() first")
        transport, control = self.transport, self.control
        self.settle()
        # A replica may not have read the previous version's closing meta yet; by now every one
        # has read all of the version before it (it took part in, or acknowledged, the last send).
        control.forget(keep_version=version - 1)
        started, total = time.perf_counter(), 0
        self._in_flight_version = version
        index = 0
        for group in group_tensors(named_tensors, self.config.bucket_bytes):
            slot = index % SLOTS
            self._release(slot)
            specs, nbytes = layout(group)
            buffer = transport.buffer(slot, nbytes)
            pack(buffer, group, specs)
            del group
            if buffer.device.type == "cuda":
                torch.cuda.current_stream(buffer.device).synchronize()  # packed before anyone reads it
            meta = BucketMeta(index, nbytes, specs)
            if nbytes:  # receivers skip empty buckets too
                meta = transport.post(slot, meta, version)
            control.publish(version, meta)
            self._in_flight[slot] = meta
            total += nbytes
            index += 1
        control.publish(version, BucketMeta(index, 0, (), last=True))
        if wait_for_receivers:
            self.settle()
        return SyncStats(version, time.perf_counter() - started, total, index)

    def settle(self) -> None:
        """Wait until every receiver has read the buckets still in flight; reclaim their slots."""
        for slot in range(SLOTS):
            self._release(slot)

    def _release(self, slot: int) -> None:
        meta = self._in_flight[slot]
        if meta is None:
            return
        if self.transport.flow_controlled:
            self.control.wait_acks(self._in_flight_version, meta.index, self.receivers)
        self.transport.reclaim(slot, meta)
        self._in_flight[slot] = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class WeightReceiver:
    """A rollout replica's side; ``index`` counts replicas from 1 (the sender is 0).

    Constructing it joins the sender (with the broadcast backend, it waits for
    :meth:`WeightSender.connect`). ``device`` is where broadcast buckets land (the replica's).
    """

    def __init__(
        self, config: CheckpointEngineConfig, address: SenderAddress, index: int, device: torch.device
    ) -> None:
        if not 1 <= index <= address.receivers:
            raise ValueError(f"receiver index {index} is outside 1..{address.receivers}")
        self.index = index
        self.control = ControlPlane(address.host, address.port, is_sender=False, timeout_s=config.timeout_s)
        self.flow_controlled = address.backend != "broadcast"
        if address.backend == "broadcast":
            group = broadcast_group(
                self.control.store, index, address.receivers + 1, address.group_backend, config.timeout_s
            )
            bucket_device = device if address.group_backend == "nccl" else torch.device("cpu")
            self.transport = BroadcastReceiver(group, bucket_device)
        elif address.backend == "shared_memory":
            self.transport = SharedMemoryReceiver()
        else:
            self.transport = FileReceiver()

    def receive(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Weight ``version``'s tensors as views of each bucket, valid until the next item is requested."""
        index = 0
        while True:
            meta = self.control.fetch(version, index)
            if meta.last:
                return
            buffer = self.transport.take(meta) if meta.nbytes else torch.empty(0, dtype=torch.uint8)
            yield from unpack(buffer, meta)
            del buffer
            if self.flow_controlled:
                self.control.ack(version, index, self.index)
            index += 1

    def close(self) -> None:
        self.transport.close()
