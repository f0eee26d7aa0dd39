"""``WorkerGroup``: one controller call becomes an SPMD call on every worker of the group.

A group owns a backend (in-process, spawned processes, or Ray actors) that runs one
call on one rank and hands back a *handle* (a ``concurrent.futures.Future`` or a Ray
``ObjectRef``). The group adds what is common: binding the ``@register``-ed methods,
splitting arguments with the method's dispatch mode, collecting outputs, and futures.

Futures chain without the controller waiting:

* into an *aligned* mode (``DP_COMPUTE``, ``ALL_TO_ALL``), an aligned future of a group of the
  same size is forwarded rank by rank: rank ``i`` receives rank ``i``'s pending output;
* into a mode that passes arguments through unchanged (``ONE_TO_ALL``, ``RANK_ZERO``), a
  future becomes one derived handle that resolves to the collected value on the backend;
* anything else (e.g. splitting a ``RANK_ZERO`` result with ``DP_COMPUTE``) waits for the
  future on the controller first.

Batches sent to workers in other processes on the controller's host travel as shared-memory
files (:mod:`tandem.protocol.shared`): only a path crosses the pipe or Ray's object store, and
the worker's tensors are views of the file. Which ranks can read the controller's
``/dev/shm`` is asked once, with a probe file; the others get the batch pickled.

A :class:`~tandem.dataplane.BatchRef` argument travels as what it is — references and per-row
scalars — and each rank fetches its rows itself (:meth:`Worker._tandem_execute`); a method
registered with ``outputs="ref"`` returns references to outputs kept in the ranks' stores.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.controller.decorator import MethodSpec, registered_methods
from tandem.controller.dispatch import ONE_TO_ALL, DispatchError, DispatchMode, MeshRank
from tandem.dataplane import BatchRef, DataPlaneConfig, Traffic
from tandem.dataplane.shm import discard_blocks_of
from tandem.protocol import Batch
from tandem.protocol.shared import BatchSharer, write_probe


class Backend(Protocol):
    """Runs calls on worker ranks; see ``local.py`` and ``ray_group.py``."""

    world_size: int
    host_pids: list[int]  # the processes running ranks on the controller's host

    def submit(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any: ...

    def result(self, rank: int, handle: Any, timeout: float | None) -> Any: ...

    def done(self, handle: Any) -> bool: ...

    def derive(self, handles: list, fn: Callable[[list], Any]) -> Any: ...

    def is_handle(self, value: Any) -> bool: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class GroupSnapshot:
    """The picklable facts a dispatch mode reads about a group (size and declared meshes)."""

    world_size: int
    meshes: dict[str, list[MeshRank]]

    def mesh_info(self, mesh: str) -> list[MeshRank]:
        return self.meshes[mesh]


class GroupFuture:
    """The pending result of a non-blocking group call; pass it to the next call or ``result()`` it."""

    def __init__(
        self, group: WorkerGroup, mode: DispatchMode, ranks: list[int], handles: list, context: Any
    ) -> None:
        self.group = group
        self.mode = mode
        self.ranks = ranks
        self.handles = handles
        self.context = context

    def done(self) -> bool:
        return all(self.group.backend.done(h) for h in self.handles)

    def result(self, timeout: float | None = None) -> Any:
        """Wait for every rank and collect; a worker's exception is raised as ``WorkerError`` with its rank."""
        outputs = [
            self.group.backend.result(r, h, timeout) for r, h in zip(self.ranks, self.handles, strict=True)
        ]
        return self.mode.collect(self.group.snapshot(), outputs, self.context)

    def is_aligned_with(self, group: WorkerGroup) -> bool:
        """Rank ``i`` of ``group`` can take this future's rank-``i`` handle as it is."""
        return (
            self.mode.aligned
            and self.ranks == list(range(group.world_size))
            and all(group.backend.is_handle(h) for h in self.handles)
        )


def _collect_values(mode: DispatchMode, snapshot: GroupSnapshot, context: Any, values: list) -> Any:
    return mode.collect(snapshot, values, context)


class BoundMethod:
    """A worker method as the controller sees it: call it like the method, get the collected result."""

    def __init__(self, group: WorkerGroup, path: str, spec: MethodSpec) -> None:
        self.group, self.path, self.spec = group, path, spec
        self.__name__ = path

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.group.call(self.path, self.spec, args, kwargs)

    def __repr__(self) -> str:
        return f"<{self.path} dispatch={self.spec.dispatch.name} execute={self.spec.execute} blocking={self.spec.blocking}>"


class RoleView:
    """The methods of one role in a colocated group (``group.actor.update(...)``)."""

    def __init__(self, group: WorkerGroup, role: str, role_cls: type) -> None:
        self.group, self.role = group, role
        for name, spec in registered_methods(role_cls).items():
            setattr(self, name, BoundMethod(group, f"{role}.{name}", spec))

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def backend(self) -> Backend:
        """The group's backend (a role runs in its group's processes)."""
        return self.group.backend

    def ranks_seeing(self, directory: str) -> set[int]:
        """See :meth:`WorkerGroup.ranks_seeing` (a role runs in its group's processes)."""
        return self.group.ranks_seeing(directory)

    def ranks_reading(self, path: str, token: str) -> set[int]:
        """See :meth:`WorkerGroup.ranks_reading`."""
        return self.group.ranks_reading(path, token)

    def release_refs(self, ref: BatchRef) -> None:
        """See :meth:`WorkerGroup.release_refs` (a role's blocks are its group's processes')."""
        self.group.release_refs(ref)


class WorkerGroup:
    """A set of workers of one class (or one process per rank holding several colocated roles).

    Build one with :func:`tandem.controller.create_worker_group`; every ``@register``-ed method
    of the worker class becomes a method of the group.
    """

    def __init__(
        self,
        backend: Backend,
        worker_cls: type,
        roles: dict[str, type] | None = None,
        sharer: BatchSharer | None = None,
    ) -> None:
        self.backend = backend
        self.worker_cls = worker_cls
        self._meshes: dict[str, list[MeshRank]] = {}
        # Workers in the controller's own process take the batch object itself.
        self.sharer = None if getattr(backend, "same_process", False) else (sharer or BatchSharer())
        self._shared_ranks: set[int] | None = None  # ranks that read the controller's /dev/shm (probed once)
        self._data_plane = DataPlaneConfig()  # where the ranks put kept outputs (use_data_store)
        for name, spec in registered_methods(worker_cls).items():
            if hasattr(WorkerGroup, name):
                raise ValueError(
                    f"{worker_cls.__name__}.{name} is registered, but WorkerGroup.{name} is the group's own; "
                    "rename the worker method"
                )
            setattr(self, name, BoundMethod(self, name, spec))
        self.roles = dict(roles or {})
        for role, role_cls in self.roles.items():
            setattr(self, role, RoleView(self, role, role_cls))

    @property
    def world_size(self) -> int:
        return self.backend.world_size

    def snapshot(self) -> GroupSnapshot:
        return GroupSnapshot(self.world_size, dict(self._meshes))

    def mesh_info(self, mesh: str) -> list[MeshRank]:
        """Each rank's declared place in ``mesh`` (asked once, then cached)."""
        if mesh not in self._meshes:
            handles = [
                self.backend.submit(r, "_tandem_mesh_rank", (mesh,), {}) for r in range(self.world_size)
            ]
            ranks = [self.backend.result(r, h, None) for r, h in enumerate(handles)]
            if len({m.dp_size for m in ranks}) != 1:
                raise DispatchError(
                    f"ranks disagree on the dp size of mesh {mesh!r}: {[m.dp_size for m in ranks]}"
                )
            self._meshes[mesh] = ranks
        return self._meshes[mesh]

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Run any worker method (registered or not) on every rank with the same arguments; list of results."""
        return self.call(method, MethodSpec(ONE_TO_ALL, "all", True), args, kwargs)

    def call(self, path: str, spec: MethodSpec, args: tuple, kwargs: dict) -> Any:
        """Split ``args``/``kwargs`` by the dispatch mode, run on the executing ranks, collect (or return a future)."""
        mode = spec.dispatch
        per_args, per_kwargs, context = self._split(mode, args, kwargs)
        if len(per_args) != self.world_size or len(per_kwargs) != self.world_size:
            raise DispatchError(
                f"dispatch mode {mode.name} produced {len(per_args)} calls for {self.world_size} workers"
            )
        ranks = [r for r in range(self.world_size) if per_args[r] is not None]
        if spec.execute == "rank_zero":
            ranks = [0]
        # A backend that can run a blocking call on this thread does (the in-process one).
        submit = getattr(self.backend, "submit_here", None) if spec.blocking else None
        submit = submit or self.backend.submit
        handles = [
            submit(r, path, *self._shared(r, tuple(per_args[r]), dict(per_kwargs[r] or {}))) for r in ranks
        ]
        future = GroupFuture(self, mode, ranks, handles, context)
        return future if not spec.blocking else future.result()

    def _shared(self, rank: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` for ``rank`` with each large batch replaced by a shared-memory file
        when the rank can read it (see the module docstring)."""
        if self.sharer is None or not any(isinstance(v, Batch) for v in (*args, *kwargs.values())):
            return args, kwargs
        if rank not in self.shared_memory_ranks():
            return args, kwargs
        share = self.sharer.share
        return (
            tuple(share(v) if isinstance(v, Batch) else v for v in args),
            {k: share(v) if isinstance(v, Batch) else v for k, v in kwargs.items()},
        )

    def shared_memory_ranks(self) -> set[int]:
        """The ranks whose process sees this process's shared-memory directory (asked once)."""
        if self._shared_ranks is None:
            self._shared_ranks = (
                set() if self.sharer is None else self.ranks_seeing(str(self.sharer.directory))
            )
        return self._shared_ranks

    def ranks_seeing(self, directory: str) -> set[int]:
        """The ranks whose process sees the files this process writes in ``directory`` (a probe
        file with a random token: same host, same mount)."""
        path, token = write_probe(directory)
        try:
            return self.ranks_reading(path, token)
        finally:
            os.unlink(path)

    def ranks_reading(self, path: str, token: str) -> set[int]:
        """The ranks whose process reads ``token`` in the probe file ``path`` (written by
        :func:`~tandem.protocol.shared.write_probe`, here or in another group's worker)."""
        handles = [
            self.backend.submit(r, "_tandem_read_probe", (path, token), {}) for r in range(self.world_size)
        ]
        seen = [self.backend.result(r, h, None) for r, h in enumerate(handles)]
        return {r for r, ok in enumerate(seen) if ok}

    def _split(self, mode: DispatchMode, args: tuple, kwargs: dict) -> tuple[list, list, Any]:
        values = [*args, *kwargs.values()]
        futures = [v for v in values if isinstance(v, GroupFuture)]
        if not futures:
            return mode.split(self, args, kwargs)
        if mode.aligned and all(isinstance(v, GroupFuture) and v.is_aligned_with(self) for v in values):
            # Rank i gets rank i's pending output; the padding of the first future carries through.
            per_args = [tuple(v.handles[r] for v in args) for r in range(self.world_size)]
            per_kwargs = [{k: v.handles[r] for k, v in kwargs.items()} for r in range(self.world_size)]
            return per_args, per_kwargs, futures[0].context
        if mode.opaque_args:
            swap = {id(f): self._derive_collected(f) for f in futures}
            args = tuple(swap.get(id(v), v) for v in args)
            kwargs = {k: swap.get(id(v), v) for k, v in kwargs.items()}
            return mode.split(self, args, kwargs)
        args = tuple(v.result() if isinstance(v, GroupFuture) else v for v in args)
        kwargs = {k: (v.result() if isinstance(v, GroupFuture) else v) for k, v in kwargs.items()}
        return mode.split(self, args, kwargs)

    def _derive_collected(self, future: GroupFuture) -> Any:
        if not all(self.backend.is_handle(h) for h in future.handles):
            return future.result()  # handles of another kind of backend cannot travel; wait here
        collect = functools.partial(_collect_values, future.mode, future.group.snapshot(), future.context)
        return self.backend.derive(future.handles, collect)

    # ------------------------------------------------------------------ the data plane
    def use_data_store(self, config: DataPlaneConfig) -> None:
        """Every rank puts its kept outputs into ``config``'s store from now on (default: shm)."""
        self.execute_all("_tandem_set_data_store", config)
        self._data_plane = config

    def data_traffic(self) -> list[Traffic]:
        """Each rank's data-plane byte counters since its process started, in rank order."""
        return self.execute_all("_tandem_data_traffic")

    def release_refs(self, ref: BatchRef) -> None:
        """Release the blocks ``ref``'s rows live in, on every rank (the one that put a Ray block
        drops it; a shared-memory block's file is deleted by whichever rank gets there first)."""
        blocks = ref.blocks()
        if blocks:
            self.execute_all("_tandem_release_blocks", blocks)

    def restart(self, rank: int) -> None:
        """Replace rank ``rank``'s worker by a fresh one built with the group's arguments (a dead
        or hung rollout replica). Only for workers that share no process group; the in-process
        backend cannot (it would restart the controller)."""
        restart = getattr(self.backend, "restart", None)
        if restart is None:
            raise ValueError(f"a {type(self.backend).__name__} cannot restart a worker")
        restart(rank)
        self._shared_ranks = None  # the new process is asked again which files it sees

    def shutdown(self) -> None:
        """Stop every worker (idempotent) and delete batch files no worker opened, and the
        data-plane block files the workers on this host left."""
        pids = [] if getattr(self.backend, "same_process", False) else list(self.backend.host_pids)
        self.backend.shutdown()
        if self.sharer is not None:
            self.sharer.discard_all()
        for pid in pids:
            discard_blocks_of(pid, self._data_plane.directory)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
