"""Keeping a training engine's state off the GPU while a phase does not need it.

In the colocated loop one GPU holds the actor (parameters, gradients, optimizer state), the
reference and the rollout engine (its own weights and KV cache), but no phase needs all of
them at once: generation reads only the rollout's weights, log-probs read the parameters,
only the update reads the optimizer state. A :class:`Residency` tracks where one engine's
parameters and optimizer state are and moves them on demand: :meth:`Residency.offload` to
the CPU (then hands the freed blocks back to the driver, so the rollout engine's allocator
can use them) and :meth:`Residency.load` back, before the engine computes.

The move itself is :class:`HostCopies`: each tensor's device storage is copied to host memory
(page-locked for a GPU: the copies run asynchronously at full bus speed, with one wait for all
of them) and resized to nothing *in place*, then resized and refilled on the way back. The tensors never
change device, shape or identity, so everything holding them stays valid: the optimizer's
references, FSDP2's shards and, unlike ``Module.to``, DDP's gradient hooks (autograd drops a
parameter's gradient accumulator, where DDP's hooks live, when its data changes device).

Only what the configuration allows moves, and only on an accelerator: on the CPU the state
is already where an offload would put it, so both calls do nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from tandem.device import host_buffer, release_cached_memory, wait_for_copies
from tandem.engine.base import TrainEngine


@dataclass(frozen=True)
class OffloadConfig:
    """What of one model's training state may wait on the CPU while the model does not compute
    (``actor.offload.*``, ``critic.offload.*``).

    Attributes:
        params: the parameters (gradients stay: offloads happen between optimizer steps, when there are none).
        optimizer: the optimizer state (AdamW's moments); needed only by the update.
    """

    params: bool = False
    optimizer: bool = False


def storage_of(tensor: torch.Tensor) -> torch.UntypedStorage:
    """The storage holding ``tensor``'s data (a DTensor's: its local shard's)."""
    return (tensor._local_tensor if isinstance(tensor, DTensor) else tensor).untyped_storage()


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A byte tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


HOST_BLOCK_BYTES = 256 * 2**20  # a power of two: PyTorch's page-locked cache rounds each request up to one


class _HostBlocks:
    """Host memory for ``total`` bytes of ``device``'s data, carved in order from blocks of
    :data:`HOST_BLOCK_BYTES` (the last one smaller). Page-locked requests are rounded up to a
    power of two and cached for reuse; blocks of one size keep that to the last block's slack,
    where one buffer per storage could come close to doubling the host memory."""

    def __init__(self, total: int, device: torch.device) -> None:
        self.left, self.device = total, device
        self.block = torch.empty(0, dtype=torch.uint8)
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A host byte tensor of ``nbytes``, or of what is left of the current block if less."""
        if self.used == self.block.numel():
            self.block, self.used = host_buffer(min(HOST_BLOCK_BYTES, self.left), self.device), 0
        size = min(nbytes, self.block.numel() - self.used)
        piece = self.block[self.used : self.used + size]
        self.used += size
        self.left -= size
        return piece


class HostCopies:
    """The storages of ``tensors`` copied to host memory and freed in place; :meth:`restore`
    reallocates them on their device and copies the data back.

    A storage shared by several tensors moves once. Storages that cannot be resized (weights
    memory-mapped from a file, on the CPU) stay where they are. A storage's bytes may span two
    or more host blocks (:class:`_HostBlocks`).
    """

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        storages: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            storage = storage_of(tensor)
            if storage.nbytes() and storage.resizable():
                storages.setdefault(storage.data_ptr(), storage)
        blocks: dict[torch.device, _HostBlocks] = {}
        for storage in storages.values():
            blocks.setdefault(storage.device, _HostBlocks(0, storage.device)).left += storage.nbytes()
        self._saved: list[tuple[torch.UntypedStorage, list[torch.Tensor]]] = []
        for storage in storages.values():
            source, pieces, offset = _as_bytes(storage), [], 0
            while offset < storage.nbytes():
                piece = blocks[storage.device].take(storage.nbytes() - offset)
                piece.copy_(source[offset : offset + piece.numel()], non_blocking=piece.is_pinned())
                pieces.append(piece)
                offset += piece.numel()
            self._saved.append((storage, pieces))
        for device in blocks:
            wait_for_copies(device)  # every copy has landed before its device memory goes
        for storage, _ in self._saved:
            storage.resize_(0)

    @property
    def nbytes(self) -> int:
        """Bytes held on the host."""
        return sum(piece.numel() for _, pieces in self._saved for piece in pieces)

    def restore(self) -> None:
        """Reallocate every storage and copy its data back (once; later calls do nothing)."""
        for storage, pieces in self._saved:
            storage.resize_(sum(piece.numel() for piece in pieces))
            target, offset = _as_bytes(storage), 0
            for piece in pieces:
                # queued on the device's stream, so the kernels after it read the data; the
                # page-locked block is not reused before the copy is done (PyTorch records it)
                target[offset : offset + piece.numel()].copy_(piece, non_blocking=piece.is_pinned())
                offset += piece.numel()
        self._saved = []


class Residency:
    """Where ``engine``'s parameters and optimizer state live: on ``device`` or on the CPU.

    Args:
        engine: the engine whose state moves (its :meth:`~TrainEngine.offload` and ``reload``).
        device: the engine's compute device.
        params: the parameters may be offloaded.
        optimizer: the optimizer state may be offloaded.
    """

    def __init__(self, engine: TrainEngine, device: torch.device, params: bool, optimizer: bool) -> None:
        self.engine = engine
        self.device = device
        moves = device.type != "cpu"
        self.offloads_params = params and moves
        self.offloads_optimizer = optimizer and moves
        self.params_resident = True
        self.optimizer_resident = True

    def offload(self, params: bool = True, optimizer: bool = True) -> None:
        """Move what is allowed among ``params`` / ``optimizer`` to the CPU (what is already there stays)."""
        move_params = params and self.offloads_params and self.params_resident
        move_optimizer = optimizer and self.offloads_optimizer and self.optimizer_resident
        if not (move_params or move_optimizer):
            return
        self.engine.offload(model=move_params, optimizer=move_optimizer)
        self.params_resident &= not move_params
        self.optimizer_resident &= not move_optimizer
        release_cached_memory(self.device)

    def load(self, optimizer: bool = False) -> None:
        """Bring the parameters (and the optimizer state when ``optimizer``) back to the device."""
        move_params = not self.params_resident
        move_optimizer = optimizer and not self.optimizer_resident
        if move_params or move_optimizer:
            self.engine.reload(model=move_params, optimizer=move_optimizer)
        self.params_resident = True
        self.optimizer_resident |= optimizer

    @contextlib.contextmanager
    def computing(self, optimizer: bool = False) -> Iterator[None]:
        """On the device for the block (the optimizer state too when ``optimizer``), offloaded
        again after it: for a model that waits on the CPU between its passes."""
        self.load(optimizer=optimizer)
        yield
        self.offload()

    @property
    def state(self) -> str:
        """``resident``, ``optimizer offloaded``, ``parameters offloaded`` or ``offloaded`` (for logs and tests)."""
        if self.params_resident and self.optimizer_resident:
            return "resident"
        if self.params_resident:
            return "optimizer offloaded"
        return "parameters offloaded" if self.optimizer_resident else "offloaded"
