"""One engine on this rank: the set-up every worker that holds a torch engine shares.

The actor, critic and teacher of the RL trainer, the SFT/DPO/RM trainers' engine rank and the
RL reward-model scorer each hold one :class:`~tandem.engine.TorchTrainEngine` per rank. They set
it up here, in one order:

1. :func:`bind_rank`: HF progress bars off, this rank's device bound from the user's setting
   (``trainer.device``, ``engine.device``) and the worker's local rank.
2. :func:`start_engine`: the strategy the group runs (:func:`~tandem.engine.parallel.rank_strategy`:
   ``single`` alone, DDP for ``single`` over several ranks; a *frozen* engine — forward only,
   the teacher, a reward model — is never DDP: it has no gradients to reduce, each rank a whole
   copy), the process group joined when the engine's ranks talk to each other (DDP or FSDP2,
   or rows split over ``sp_size`` / ``tp_size`` / ``ep_size``), the engine built and
   initialised, and this rank's place in the worker's named mesh declared for
   ``mesh_dispatch`` (:func:`mesh_place`).
3. :func:`parked` for an engine whose state waits on the CPU between its passes, and
   :class:`EngineCheckpoints` for the plain save/load of ``self.engine``.

:func:`mesh_place` is where each worker's "which rank reports its rows" comes from, and it is
:class:`~tandem.engine.parallel_dims.ParallelDims`' arithmetic (:meth:`~ParallelDims.mesh_rank`):
the ranks of one sequence- or tensor-parallel group hold the same rows and only the first of them
(``sp_rank`` and ``tp_rank`` 0) is collected; expert parallelism splits no rows; an engine alone
on its rank (a frozen whole copy, no collectives) is data-parallel rank ``rank`` of the group.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from transformers.utils import logging as hf_logging

from tandem.controller import Worker, register
from tandem.controller.dispatch import MeshRank
from tandem.device import bind_device
from tandem.engine.config import EngineConfig
from tandem.engine.mesh import EngineMesh
from tandem.engine.offload import Residency
from tandem.engine.parallel import rank_strategy
from tandem.engine.parallel_dims import ParallelDims
from tandem.engine.torch_engine import TorchTrainEngine


def bind_rank(worker: Worker, device_setting: str) -> torch.device:
    """This rank's device for ``device_setting`` (``auto``, ``cpu``, ``cuda``, ``cuda:1``, ...)
    and the worker's local rank, made the process's current one; HF progress bars off."""
    hf_logging.disable_progress_bar()
    return bind_device(device_setting, worker.local_rank)


def group_strategy(configured: str, world_size: int, tp_size: int = 1, frozen: bool = False) -> str:
    """The strategy each of ``world_size`` ranks runs for the ``configured`` one: see
    :func:`~tandem.engine.parallel.rank_strategy`; a ``frozen`` engine runs ``single`` where that
    gives DDP (DDP only reduces gradients; each rank scores its own rows with a whole copy)."""
    strategy = rank_strategy(configured, world_size, tp_size)
    return "single" if frozen and strategy == "ddp" else strategy


def talks_to_peers(config: EngineConfig) -> bool:
    """Whether ``config``'s engine runs collectives: data parallel (DDP, FSDP2) or rows split over
    sequence-, tensor- or expert-parallel ranks."""
    return config.strategy != "single" or max(config.sp_size, config.tp_size, config.ep_size) > 1


def mesh_place(mesh: EngineMesh, rank: int, world_size: int) -> MeshRank:
    """Rank ``rank``'s place, in a worker group of ``world_size``, for ``mesh_dispatch``: its
    engine mesh's degrees' :meth:`ParallelDims.mesh_rank` of its place in the mesh (the worker
    group is the engine's world); an engine alone (a one-rank mesh) on
    a rank of a larger group is data-parallel rank ``rank`` of ``world_size``. Raises
    ``ValueError`` when the mesh spans another number of ranks than the group."""
    if mesh.world_size == world_size:
        return mesh.dims.mesh_rank(mesh.rank)
    if mesh.world_size == 1:
        return ParallelDims(world_size).mesh_rank(rank)
    raise ValueError(
        f"the engine's mesh spans {mesh.world_size} ranks but its worker group has {world_size}: "
        "an engine's ranks are all the group's or one"
    )


def start_engine(
    worker: Worker, config: EngineConfig, *, mesh: str | None = None, frozen: bool = False
) -> TorchTrainEngine:
    """``config``'s engine on this rank, initialised; ``config.device`` is the bound device
    (:func:`bind_rank`) and ``config.strategy`` the configured one, which becomes the group's
    (:func:`group_strategy`). Joins the worker's process group when the engine runs collectives,
    declares this rank's place in ``mesh`` (:func:`mesh_place`; none for a worker dispatched by
    plain rank), and freezes the parameters of a ``frozen`` engine."""
    strategy = group_strategy(config.strategy, worker.world_size, config.tp_size, frozen)
    config = dataclasses.replace(config, strategy=strategy)
    if worker.world_size > 1 and talks_to_peers(config):
        worker.init_process_group(device=config.device)
    engine = TorchTrainEngine(config)
    engine.initialize()
    if frozen:
        engine.causal_lm.requires_grad_(False)
    if mesh is not None:
        place = mesh_place(engine.mesh, worker.rank, worker.world_size)
        worker.set_mesh_rank(mesh, place.dp_rank, place.dp_size, is_collect=place.is_collect)
    return engine


def frozen_copy(config: EngineConfig) -> TorchTrainEngine:
    """A frozen engine of ``config`` (a reference: log-probs only) on an already-set-up rank."""
    engine = TorchTrainEngine(config)
    engine.initialize()
    engine.causal_lm.requires_grad_(False)
    return engine


def parameter_count(engine: TorchTrainEngine) -> int:
    """The parameters of ``engine``'s model (what ``init_model`` reports)."""
    return sum(p.numel() for p in engine.causal_lm.parameters())


def parked(engine: TorchTrainEngine, params: bool, optimizer: bool = False) -> Residency:
    """``engine``'s :class:`Residency`, its state moved to the CPU now where ``params`` /
    ``optimizer`` allow (on an accelerator): it waits there between its passes."""
    residency = Residency(engine, engine.device, params, optimizer)
    residency.offload()
    return residency


class EngineCheckpoints:
    """``save_checkpoint`` / ``load_checkpoint`` of a worker's ``self.engine``: model, optimizer,
    scheduler, step and RNG states under ``path`` (every rank its part), with the state on the
    device while it is written or read when ``self.residency`` parks it elsewhere."""

    engine: TorchTrainEngine
    residency: Residency | None = None

    @contextlib.contextmanager
    def _engine_resident(self) -> Iterator[None]:
        if self.residency is None:
            yield
            return
        with self.residency.computing(optimizer=True):
            yield

    @register(dispatch="ONE_TO_ALL")
    def save_checkpoint(self, path: str) -> None:
        """The engine's model, optimizer, scheduler, step and RNG states under ``path``."""
        with self._engine_resident():
            self.engine.save(path)

    @register(dispatch="ONE_TO_ALL")
    def load_checkpoint(self, path: str) -> None:
        """The states :meth:`save_checkpoint` wrote under ``path``."""
        with self._engine_resident():
            self.engine.load(path)
