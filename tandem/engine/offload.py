"""Keeping a training engine's state off the GPU while a phase does not need it.

In the colocated loop one GPU holds the actor (parameters, gradients, optimizer state), the
reference and the rollout engine (its own weights and KV cache), but no phase needs all of
them at once: generation reads only the rollout's weights, log-probs read the parameters,
only the update reads the optimizer state. A :class:`Residency` tracks where one engine's
parameters and optimizer state are and moves them on demand: :meth:`Residency.offload` to
the CPU (then hands the freed blocks back to the driver, so the rollout engine's allocator
can use them) and :meth:`Residency.load` back, before the engine computes.

Only what the configuration allows moves, and only on an accelerator: on the CPU the state
is already where an offload would put it, so both calls do nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tandem.device import release_cached_memory
from tandem.engine.base import TrainEngine

HOST = torch.device("cpu")


@dataclass(frozen=True)
class OffloadConfig:
    """What of one model's training state may wait on the CPU while the model does not compute
    (``actor.offload.*``, ``critic.offload.*``).

    Attributes:
        params: the parameters (with their gradients).
        optimizer: the optimizer state (AdamW's moments); needed only by the update.
    """

    params: bool = False
    optimizer: bool = False


class Residency:
    """Where ``engine``'s parameters and optimizer state live: on ``device`` or on the CPU.

    Args:
        engine: the engine whose state moves (its :meth:`~TrainEngine.to`).
        device: the engine's compute device.
        params: the parameters (with their gradients) may be offloaded.
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
        self.engine.to(HOST, model=move_params, optimizer=move_optimizer)
        self.params_resident &= not move_params
        self.optimizer_resident &= not move_optimizer
        release_cached_memory(self.device)

    def load(self, optimizer: bool = False) -> None:
        """Bring the parameters (and the optimizer state when ``optimizer``) back to the device."""
        move_params = not self.params_resident
        move_optimizer = optimizer and not self.optimizer_resident
        if move_params or move_optimizer:
            self.engine.to(self.device, model=move_params, optimizer=move_optimizer)
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
