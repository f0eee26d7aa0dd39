"""``Worker``: the base class of every process a worker group runs."""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.config.plugins import load_plugins_from_env
from tandem.controller.decorator import SPEC_ATTR, MethodSpec
from tandem.controller.dispatch import MeshRank
from tandem.controller.errors import WorkerError
from tandem.controller.network import rendezvous_host, route_collectives_through
from tandem.dataplane import BatchRef, Block, DataPlaneConfig, Traffic, store_for, traffic
from tandem.dataplane import get as get_block
from tandem.dataplane import release as release_block
from tandem.dataplane.images import materialise_with_images
from tandem.device import process_group_backend
from tandem.protocol import Batch
from tandem.protocol.shared import SharedBatch, read_probe

DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistInfo:
    """Where a worker sits: global rank and size, rank and size on its node, and the rendezvous address."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def as_env(self) -> dict[str, str]:
        """The torch.distributed ``env://`` variables for this worker."""
        values = (
            self.rank,
            self.world_size,
            self.local_rank,
            self.local_world_size,
            self.master_addr,
            self.master_port,
        )
        return {key: str(value) for key, value in zip(DIST_ENV, values, strict=True)}

    @staticmethod
    def from_env() -> DistInfo:
        """Read the variables a worker group set for this process (defaults: a single process)."""
        env = os.environ
        return DistInfo(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 0)),
        )


def host_rendezvous_store() -> dist.TCPStore:
    """A rendezvous store served from this process on a port the system picks while binding it
    (``.port``); workers join it as clients. Picking a free port first and binding it later
    leaves a window in which another process can take the port."""
    return dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)


class Worker:
    """Base class for workers: knows its place in the group and can join a collective group.

    Subclasses define methods decorated with ``@register(...)``; a ``WorkerGroup`` exposes
    them on the controller. The group sets the process's ``RANK``/``WORLD_SIZE``/... variables
    (``env://`` for torch.distributed) before constructing the worker, except for in-process
    workers, which get their :class:`DistInfo` passed directly and leave the controller's
    environment alone.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Worker:
        """Import the plugins the group named for this process (``TANDEM_PLUGINS``, set beside
        ``RANK``) before the worker is built, whichever backend builds it: the names they register
        resolve in the worker as in the controller (:mod:`tandem.config.plugins`)."""
        load_plugins_from_env()
        return super().__new__(cls)

    @property
    def dist_info(self) -> DistInfo:
        """This worker's place; subclasses need not call ``super().__init__()`` for it to work."""
        info = self.__dict__.get("_tandem_dist_info")
        if info is None:
            info = self.__dict__.setdefault("_tandem_dist_info", DistInfo.from_env())
        return info

    @property
    def rank(self) -> int:
        return self.dist_info.rank

    @property
    def world_size(self) -> int:
        return self.dist_info.world_size

    @property
    def local_rank(self) -> int:
        return self.dist_info.local_rank

    def init_process_group(
        self, backend: str | None = None, timeout_s: float = 120.0, device: torch.device | str = "cpu"
    ) -> None:
        """Join the group's torch.distributed process group.

        The backend follows the device the collectives' tensors live on (NCCL for CUDA, gloo for
        the CPU; :func:`tandem.device.process_group_backend`) unless ``backend`` names one.
        """
        if dist.is_initialized():
            return
        backend = backend or process_group_backend(device)
        route_collectives_through(rendezvous_host())
        info = self.dist_info
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend, store=self._rendezvous_store(timeout), rank=info.rank,
            world_size=info.world_size, timeout=timeout,
        )  # fmt: skip

    def _rendezvous_store(self, timeout: timedelta) -> dist.Store:
        """The store the ranks meet through: the one this worker hosts (Ray's rank 0, see
        :meth:`_tandem_claim_master`), a client of the one at ``master_addr:master_port``, or a
        store of its own for a world of one."""
        store = self.__dict__.get("_tandem_store")
        if store is None and self.world_size == 1:
            store = dist.HashStore()
        if store is None:
            info = self.dist_info
            store = dist.TCPStore(info.master_addr, info.master_port, is_master=False, timeout=timeout)
        store.set_timeout(timeout)
        return store

    def set_mesh_rank(self, mesh: str, dp_rank: int, dp_size: int, is_collect: bool) -> None:
        """Declare this worker's data-parallel place in ``mesh`` for ``mesh_dispatch(mesh)`` calls."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size}) for mesh {mesh!r}")
        self.__dict__.setdefault("_tandem_mesh_ranks", {})[mesh] = MeshRank(dp_rank, dp_size, is_collect)

    def _tandem_mesh_rank(self, mesh: str) -> MeshRank:
        ranks = self.__dict__.get("_tandem_mesh_ranks", {})
        if mesh not in ranks:
            raise ValueError(
                f"worker rank {self.rank} has not declared its place in mesh {mesh!r} (set_mesh_rank)"
            )
        return ranks[mesh]

    def _tandem_read_probe(self, path: str, token: str) -> bool:
        """Whether this process sees the controller's shared-memory probe file (same host and
        ``/dev/shm``): then batches may reach it as :class:`~tandem.protocol.shared.SharedBatch`."""
        return read_probe(path, token)

    def _tandem_process(self) -> tuple[int, str | None]:
        """This worker's process id and its Ray node's id (None outside Ray)."""
        ray = sys.modules.get("ray")
        node = ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else None
        return os.getpid(), node

    def _tandem_claim_master(self) -> tuple[str, int]:
        """Rank 0 hosts the group's rendezvous store on its own host and names the address. The
        store binds a port the system picks, so no other process can take it in between."""
        if self.world_size == 1:  # a world of one meets no one (see _rendezvous_store)
            return self.dist_info.master_addr, self.dist_info.master_port
        store = host_rendezvous_store()
        self.__dict__["_tandem_store"] = store
        info = replace(self.dist_info, master_addr=rendezvous_host(), master_port=store.port)
        self.__dict__["_tandem_dist_info"] = info
        os.environ.update(info.as_env())
        return info.master_addr, info.master_port

    # ------------------------------------------------------------------ the data plane
    def _tandem_set_data_store(self, config: DataPlaneConfig) -> None:
        """Put this rank's kept outputs (``@register(outputs="ref")``) into ``config``'s store."""
        self.__dict__["_tandem_data_plane"] = config

    def _tandem_data_store(self) -> Any:
        return store_for(self.__dict__.get("_tandem_data_plane") or DataPlaneConfig())

    def _tandem_data_traffic(self) -> Traffic:
        """This process's data-plane byte counters (:func:`tandem.dataplane.traffic`)."""
        return traffic()

    def _tandem_release_blocks(self, blocks: list[Block]) -> None:
        """Release ``blocks`` (shared-memory files on this host; Ray blocks this process put)."""
        for block in blocks:
            release_block(block)

    def _tandem_execute(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` (a dotted path such as ``"actor.update"`` for colocated roles).

        A :class:`~tandem.dataplane.BatchRef` argument is fetched here, for every method: only
        the fields the method declares it reads (``@register(reads=...)``; declared fields the
        batch lacks are left out, as a Batch would lack them), only this rank's rows, built into
        the padded ``Batch`` a Batch argument would have been. A method declared with
        ``outputs="ref"`` and called with a ``BatchRef`` has its ``Batch`` result put into this
        rank's store and returned as a ``BatchRef`` (called with Batches, it returns its ``Batch``).

        Any exception is re-raised as :class:`WorkerError` carrying this rank and the traceback,
        so every backend reports worker failures the same way. The call is a range named
        ``method`` in profiler traces (:mod:`tandem.controller.profiling`).
        """
        target: Any = self
        try:
            for part in method.split("."):
                target = getattr(target, part)
            spec: MethodSpec | None = getattr(target, SPEC_ATTR, None)
            reads = spec.reads if spec is not None else None
            by_ref = any(isinstance(value, BatchRef) for value in (*args, *kwargs.values()))
            args = tuple(_opened(value, reads) for value in args)
            kwargs = {key: _opened(value, reads) for key, value in kwargs.items()}
            with torch.profiler.record_function(method):  # a named range in profiler traces
                result = target(*args, **kwargs)
            if by_ref and spec is not None and spec.outputs == "ref" and isinstance(result, Batch):
                return BatchRef.put(result, self._tandem_data_store())
            return result
        except Exception:
            raise WorkerError(self.rank, method, traceback.format_exc()) from None


def _opened(value: Any, reads: tuple[str, ...] | None) -> Any:
    """A :class:`SharedBatch` argument as the batch it stands for (views of the mapped file); a
    :class:`BatchRef` as the padded batch of the fields in ``reads`` (all when ``None``; a stored
    draw's ``images`` rebuilt from its columns: :mod:`tandem.dataplane.images`)."""
    if isinstance(value, SharedBatch):
        return value.open()
    if isinstance(value, BatchRef):
        return materialise_with_images(value, get_block, reads)
    return value


def construct_worker(cls: type, dist_info: DistInfo, args: tuple, kwargs: dict) -> Any:
    """Build a worker object that knows ``dist_info`` before its ``__init__`` runs."""
    worker = cls.__new__(cls)
    worker.__dict__["_tandem_dist_info"] = dist_info
    worker.__init__(*args, **kwargs)
    return worker
