"""The Ray backend: one actor per rank, placed with a placement group built from a ``ResourcePool``:
one bundle per node of the pool, each on a node of its own (:func:`placement_bundles`).

Ray is an optional dependency (``pip install tandem-rl[ray]``); ``ray.init()`` starts a
local cluster when none is running. Handles are Ray ``ObjectRef`` s, which Ray resolves on
the receiving worker, so chained calls move data worker to worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.config.plugins import plugins_env
from tandem.controller.errors import WorkerDiedError, WorkerError
from tandem.controller.ray_capacity import check_ray_cluster_holds
from tandem.controller.resource_pool import ResourcePool
from tandem.controller.worker import DistInfo

PLACEMENT_TIMEOUT_S = 60.0


def _import_ray():
    try:
        import ray
    except ImportError as error:  # pragma: no cover - exercised only without the extra
        raise ImportError("the Ray backend needs Ray: pip install 'tandem-rl[ray]'") from error
    return ray


def connect_ray(ray_init_kwargs: dict | None = None) -> Any:
    """The ``ray`` module, connected: to the cluster ``RAY_ADDRESS`` names, or a new local one."""
    ray = _import_ray()
    if not ray.is_initialized():
        ray.init(**{"include_dashboard": False, "ignore_reinit_error": True, **(ray_init_kwargs or {})})
    return ray


def placement_bundles(pool: ResourcePool) -> tuple[list[dict[str, float]], str]:
    """The placement group that holds ``pool``: one bundle a node, reserving that node's share of
    the pool in all (its processes' CPUs and GPUs; each rank's actor then takes its own from the
    bundle), and the strategy that puts each bundle on a node of its own. ``STRICT_SPREAD`` for a
    pool of several nodes: without it Ray may pack two nodes' shares onto one node that has room
    for both, and "two nodes" would not be two nodes."""
    bundles = [{kind: value for kind, value in share.items() if value} for share in pool.node_shares()]
    return bundles, "STRICT_SPREAD" if len(bundles) > 1 else "STRICT_PACK"


def _apply(fn: Callable[[list], Any], *values: Any) -> Any:
    return fn(list(values))


class RayBackend:
    """Actors for every rank of ``pool``, rank 0 first so it can publish the rendezvous address."""

    def __init__(
        self,
        worker_cls: type,
        pool: ResourcePool,
        args: tuple = (),
        kwargs: dict | None = None,
        ray_init_kwargs: dict | None = None,
    ) -> None:
        ray = connect_ray(ray_init_kwargs)
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        check_ray_cluster_holds([pool], ray)  # rather than wait out the placement timeout
        self._ray = ray
        self._remove_pg = remove_placement_group
        self._apply_task = ray.remote(num_cpus=0)(_apply)
        self.world_size = pool.world_size
        bundles, strategy = placement_bundles(pool)
        self._placement_group = placement_group(bundles, strategy=strategy)
        try:
            ray.get(self._placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise RuntimeError(
                f"Ray could not place pool {pool.name!r} ({pool.processes_per_node} processes per node, "
                f"each node's share on a node of its own: {bundles}) within {PLACEMENT_TIMEOUT_S:.0f} s; "
                f"cluster resources: {ray.cluster_resources()}"
            ) from None
        self._actor_cls = ray.remote(worker_cls)
        self._pool, self._args = pool, (args, kwargs or {})
        self._scheduling = PlacementGroupSchedulingStrategy
        self._actors: list[Any] = []
        self._master: tuple[str, int] = ("127.0.0.1", 0)
        for rank in range(self.world_size):
            self._actors.append(self._start_actor(rank))
            if rank == 0:
                claim = self._actors[0]._tandem_execute.remote("_tandem_claim_master")
                self._master = tuple(self.result(0, claim, None))
        self._here = ray.get_runtime_context().get_node_id()
        self._places = [self._place(r) for r in range(self.world_size)]

    def _start_actor(self, rank: int) -> Any:
        """Rank ``rank``'s actor in its placement-group bundle, told its place and the rendezvous address."""
        pool = self._pool
        node, local_rank = pool.node_and_local_rank(rank)
        info = DistInfo(rank, self.world_size, local_rank, pool.processes_per_node[node], *self._master)
        env = {**info.as_env(), **plugins_env()}  # the worker imports this process's plugins first
        if not pool.gpus_per_process:  # recent Ray shows every GPU to an actor that reserved none
            env["CUDA_VISIBLE_DEVICES"] = ""
        args, kwargs = self._args
        return self._actor_cls.options(
            num_cpus=pool.cpus_per_process,
            num_gpus=pool.gpus_per_process,
            scheduling_strategy=self._scheduling(
                placement_group=self._placement_group, placement_group_bundle_index=node
            ),
            runtime_env={"env_vars": env},
        ).remote(*args, **kwargs)

    def _place(self, rank: int) -> tuple[int, str | None]:
        """Rank ``rank``'s process id and node (its constructor's failure is raised here)."""
        return self.result(rank, self._actors[rank]._tandem_execute.remote("_tandem_process"), None)

    @property
    def nodes(self) -> list[str | None]:
        """The Ray node id of each rank's actor, in rank order."""
        return [node for _, node in self._places]

    @property
    def host_pids(self) -> list[int]:
        """The processes on the controller's node: whose /dev/shm files the controller can delete
        after a failure (Ray ends actors with SIGKILL, so theirs are never cleaned up by them)."""
        return [pid for pid, node in self._places if node == self._here]

    def restart(self, rank: int) -> None:
        """Replace rank ``rank``'s actor by a fresh one in the same bundle (see
        :meth:`tandem.controller.local.ProcessBackend.restart`)."""
        self._ray.kill(self._actors[rank], no_restart=True)
        self._actors[rank] = self._start_actor(rank)
        self._places[rank] = self._place(rank)

    def submit(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        return self._actors[rank]._tandem_execute.remote(method, *args, **kwargs)

    def result(self, rank: int, handle: Any, timeout: float | None) -> Any:
        ray = self._ray
        try:
            return ray.get(handle, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"worker rank {rank} did not answer within {timeout} s") from None
        except ray.exceptions.RayActorError as error:
            raise WorkerDiedError(rank, f"Ray actor died: {error}") from None
        except ray.exceptions.RayTaskError as error:
            cause = getattr(error, "cause", None)
            if isinstance(cause, (WorkerError, WorkerDiedError)):
                raise cause from None
            raise WorkerError(rank, "<ray task>", str(error)) from None

    def done(self, handle: Any) -> bool:
        ready, _ = self._ray.wait([handle], timeout=0)
        return bool(ready)

    def is_handle(self, value: Any) -> bool:
        return isinstance(value, self._ray.ObjectRef)

    def derive(self, handles: list, fn: Callable[[list], Any]) -> Any:
        """An ObjectRef of ``fn(results)``, computed by a Ray task once the inputs exist."""
        return self._apply_task.remote(fn, *handles)

    @property
    def actors(self) -> list[Any]:
        return list(self._actors)

    def shutdown(self) -> None:
        for actor in getattr(self, "_actors", []):
            self._ray.kill(actor, no_restart=True)
        self._actors = []
        if getattr(self, "_placement_group", None) is not None:
            self._remove_pg(self._placement_group)
        self._placement_group = None
