"""The checkpoint engine across worker groups: a trainer-side mixin and the controller's two calls.

A trainer worker class that holds ``self.engine`` (a training engine) mixes in
:class:`SendsWeights`; rollout replicas are :class:`tandem.pipeline.replica_worker.RolloutReplicaWorker`.
The controller wires them once with :func:`connect_weight_sync` and moves each new version
with :func:`sync_weights`. The worker groups' own call channels (Ray or local processes)
carry the sender's address; the buckets go through the chosen backend.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from tandem.checkpoint_engine.config import CheckpointEngineConfig
from tandem.checkpoint_engine.sync import SenderAddress, SyncStats, WeightSender
from tandem.controller import register
from tandem.controller.errors import WorkerDiedError, WorkerError
from tandem.errors import RolloutReplicaError
from tandem.protocol.shared import write_probe

FILE_BACKENDS = ("shared_memory", "files")  # buckets as files the replicas must be able to read


class SendsWeights:
    """Trainer-group methods: rank 0 sends; every rank walks ``iter_parameters`` (FSDP2 gathers in step)."""

    engine: Any
    rank: int
    _weight_sender: WeightSender | None = None

    @register(dispatch="ONE_TO_ALL")
    def start_weight_sender(self, config: CheckpointEngineConfig, receivers: int) -> SenderAddress | None:
        """Rank 0 opens the control plane for ``receivers`` replicas and returns its address."""
        if self.rank == 0:
            self._weight_sender = WeightSender(config, receivers, self.engine.device)
            return self._weight_sender.address
        return None

    @register(dispatch="ONE_TO_ALL", blocking=False)
    def connect_weight_sender(self) -> None:
        if self._weight_sender is not None:
            self._weight_sender.connect()

    @register(dispatch="ONE_TO_ALL", blocking=False)
    def send_weights(self, version: int, wait_for_receivers: bool = True) -> SyncStats | None:
        """Send the current weights as ``version`` (rank 0's stats; other ranks return None);
        see :meth:`WeightSender.send` for ``wait_for_receivers``."""
        tensors = self.engine.iter_parameters()
        if self._weight_sender is None:
            for _ in tensors:  # take part in each gather
                pass
            return None
        return self._weight_sender.send(tensors, version, wait_for_receivers)

    @register(dispatch="ONE_TO_ALL")
    def write_weight_probe(self, directory: str) -> tuple[str, str] | None:
        """Rank 0 (the sender) writes a probe file in ``directory`` (made if missing, as the
        sender would): ``(path, token)``."""
        if self.rank != 0:
            return None
        os.makedirs(directory, exist_ok=True)
        return write_probe(directory)

    @register(dispatch="ONE_TO_ALL")
    def remove_weight_probe(self, path: str) -> None:
        if self.rank == 0:
            os.unlink(path)

    @register(dispatch="ONE_TO_ALL")
    def close_weight_sender(self) -> None:
        if self._weight_sender is not None:
            self._weight_sender.close()
            self._weight_sender = None


def connect_weight_sync(trainer: Any, rollout: Any, config: CheckpointEngineConfig) -> SenderAddress:
    """Open the sender on trainer rank 0 and join every replica of ``rollout`` to it (the
    file-based backends first check that every replica reads the files the sender writes)."""
    if config.backend in FILE_BACKENDS:
        check_replicas_read_senders_files(trainer, rollout, config)
    address = trainer.start_weight_sender(config, rollout.world_size)[0]
    joined = [trainer.connect_weight_sender(), rollout.connect_weights(config, address)]
    for pending in joined:
        pending.result(timeout=config.timeout_s)
    return address


def check_replicas_read_senders_files(trainer: Any, rollout: Any, config: CheckpointEngineConfig) -> None:
    """Raise ``ValueError`` naming the backend key when a replica of ``rollout`` cannot read a file
    that trainer rank 0 writes where the backend puts its buckets (another machine or container)."""
    directory = config.directory or "/dev/shm"
    path, token = trainer.write_weight_probe(directory)[0]
    try:
        seen = rollout.ranks_reading(path, token)
    finally:
        trainer.remove_weight_probe(path)
    blind = [rank for rank in range(rollout.world_size) if rank not in seen]
    if blind:
        raise ValueError(
            f"pipeline.checkpoint_engine.backend={config.backend}: rollout replica {blind[0]} cannot read the "
            f"files trainer rank 0 writes in {directory} (another machine or container); use broadcast"
        )


def sync_weights(trainer: Any, rollout: Any, version: int, pause: str = "keep") -> SyncStats:
    """Move the trainer's current weights to every replica as ``version``; the sender's stats.

    A replica that fails or dies meanwhile raises :class:`RolloutReplicaError` naming it.
    """
    pending = start_weight_sync(trainer, rollout, version, pause, wait_for_receivers=True)
    pending.finish()
    return pending.stats


@dataclass
class PendingSync:
    """A weight sync the trainer has finished sending: :meth:`finish` waits until every replica
    has applied it (raising :class:`RolloutReplicaError` for one that failed)."""

    version: int
    stats: SyncStats
    received: Any  # the replicas' pending receive_weights call

    def finish(self) -> None:
        _replicas_result(self.received, self.version)


def start_weight_sync(
    trainer: Any, rollout: Any, version: int, pause: str = "keep", wait_for_receivers: bool = False
) -> PendingSync:
    """Send weights ``version``; returns once the trainer's part is done. Without
    ``wait_for_receivers`` that is when the buckets are posted (shared memory, files): the replicas
    load them while the trainer trains on, and the trainer's next send waits for them first."""
    sent = trainer.send_weights(version, wait_for_receivers)
    received = rollout.receive_weights(version, pause)
    while not sent.done():  # a failure on either side surfaces at once
        if received.done():
            _replicas_result(received, version)
        time.sleep(0.001)
    return PendingSync(version, sent.result()[0], received)


def _replicas_result(received: Any, version: int) -> None:
    try:
        received.result()
    except (WorkerError, WorkerDiedError) as error:
        raise RolloutReplicaError(
            f"rollout replica {error.rank} failed to receive weight version {version}: {error}", error.rank
        ) from error
