"""Building worker groups: one role, several colocated roles, or a whole role -> pool layout."""

from __future__ import annotations

from collections import defaultdict

from tandem.config.validation import check_choice
from tandem.controller.colocate import FusedWorker, Role
from tandem.controller.group import RoleView, WorkerGroup
from tandem.controller.local import InProcessBackend, ProcessBackend
from tandem.controller.resource_pool import ResourcePool
from tandem.device import cuda_device_count, resolve_device

BACKENDS = ("local", "process", "ray")


def create_worker_group(
    worker_cls: type,
    pool: ResourcePool | None = None,
    backend: str = "local",
    args: tuple = (),
    kwargs: dict | None = None,
    ray_init_kwargs: dict | None = None,
) -> WorkerGroup:
    """A group of ``pool.world_size`` workers of ``worker_cls``.

    ``backend``: ``local`` runs a world of one inside this process and larger worlds as
    spawned processes; ``process`` always spawns; ``ray`` places actors with Ray.
    """
    return _build(
        worker_cls, pool or ResourcePool(), backend, args, kwargs or {}, ray_init_kwargs, roles=None
    )


def create_colocated_group(
    roles: dict[str, Role],
    pool: ResourcePool | None = None,
    backend: str = "local",
    ray_init_kwargs: dict | None = None,
) -> WorkerGroup:
    """One process per rank holding every role; reach a role's methods as ``group.<role>.<method>``."""
    if not roles:
        raise ValueError("create_colocated_group needs at least one role")
    role_classes = {name: role.cls for name, role in roles.items()}
    return _build(
        FusedWorker, pool or ResourcePool(), backend, (roles,), {}, ray_init_kwargs, roles=role_classes
    )


def create_role_groups(
    roles: dict[str, Role],
    role_to_pool: dict[str, str],
    pools: dict[str, ResourcePool],
    backend: str = "local",
    ray_init_kwargs: dict | None = None,
) -> dict[str, RoleView]:
    """Place each role on its pool; roles mapped to the same pool share processes (colocated).

    Returns ``{role: view}``, where ``view.<method>`` calls that role's methods.
    """
    unmapped = sorted(set(roles) - set(role_to_pool))
    if unmapped:
        raise ValueError(f"roles {unmapped} have no pool in role_to_pool")
    unknown = sorted({p for p in role_to_pool.values() if p not in pools})
    if unknown:
        raise ValueError(f"role_to_pool names pools {unknown} that are not in pools {sorted(pools)}")
    by_pool: dict[str, dict[str, Role]] = defaultdict(dict)
    for name, role in roles.items():
        by_pool[role_to_pool[name]][name] = role
    views: dict[str, RoleView] = {}
    groups: list[WorkerGroup] = []
    try:
        for pool_name, pool_roles in by_pool.items():
            groups.append(create_colocated_group(pool_roles, pools[pool_name], backend, ray_init_kwargs))
            views.update({name: getattr(groups[-1], name) for name in pool_roles})
    except BaseException:
        for group in groups:  # do not leak the pools already placed
            group.shutdown()
        raise
    return views


def check_placement(
    pools: list[ResourcePool],
    backend: str,
    keys: str,
    device: tuple[str, str] = ("device", "auto"),
    ray_init_kwargs: dict | None = None,
) -> None:
    """Refuse at once (``ValueError``) a placement the machines could never hold, rather than
    wait for it (Ray) or fail at the first collective (two ranks on one GPU) or in a worker.

    With Ray, the pools together against the cluster's alive nodes
    (:func:`~tandem.controller.ray_capacity.check_cluster_holds`), and a CUDA device only for
    pools that reserve GPUs (a Ray worker sees only the GPUs it reserved). On one machine, a
    CUDA device against the GPUs this process sees, and the first pool's GPU workers against
    them (each GPU worker needs a GPU of its own, including ``auto`` workers on a machine with
    GPUs); later pools may share those GPUs. ``keys`` names the config keys that shaped the
    pools, ``device`` the workers' device setting as ``(key, value)``, for the messages.
    """
    check_choice("worker_group", "backend", backend, BACKENDS)
    device_key, setting = device
    wants_cuda = setting.startswith("cuda")
    if backend == "ray":
        for pool in pools:
            if wants_cuda and not pool.gpus_per_process:
                raise ValueError(
                    f"{device_key}={setting!r}, but pool {pool.name!r} reserves no GPUs and a Ray worker sees "
                    f"only the GPUs it reserves; give its workers GPUs (the pools follow {keys})"
                )
        from tandem.controller.ray_capacity import check_ray_cluster_holds  # Ray is optional (the ray extra)
        from tandem.controller.ray_group import connect_ray

        try:
            check_ray_cluster_holds(pools, connect_ray(ray_init_kwargs))
        except ValueError as error:
            raise ValueError(f"{error}; the pools follow {keys}") from None
        return
    pool = pools[0]
    gpus = cuda_device_count()
    if wants_cuda:
        try:
            resolve_device(setting)
        except RuntimeError:
            raise ValueError(
                f"{device_key}={setting!r} asks for a CUDA GPU and this machine sees {gpus}"
                + (" (auto picks the CPU then)" if not gpus else "")
            ) from None
    # Workers compute on GPUs when the pool reserves them or the device setting lands on CUDA;
    # NCCL refuses two ranks on one GPU.
    on_gpus = bool(pool.gpus_per_process) or (setting != "cpu" and gpus > 0)
    if on_gpus and pool.world_size > gpus:
        raise ValueError(
            f"pool {pool.name!r} wants {pool.world_size} GPU workers on this machine and it sees {gpus} GPU(s); "
            f"the pool follows {keys} (CPU workers: "
            + ("leave the GPU count at 0)" if not gpus else f"{device_key}=cpu and the GPU count at 0)")
        )


def _build(worker_cls, pool, backend, args, kwargs, ray_init_kwargs, roles) -> WorkerGroup:
    check_choice("worker_group", "backend", backend, BACKENDS)
    if backend == "ray":
        from tandem.controller.ray_group import RayBackend  # Ray is optional (the ray extra)

        return WorkerGroup(RayBackend(worker_cls, pool, args, kwargs, ray_init_kwargs), worker_cls, roles)
    if len(pool.processes_per_node) > 1:
        raise ValueError(
            f"the {backend!r} backend runs on one machine; pool {pool.name!r} spans several nodes"
        )
    if backend == "local" and pool.world_size == 1:
        return WorkerGroup(InProcessBackend(worker_cls, args, kwargs), worker_cls, roles)
    return WorkerGroup(ProcessBackend(worker_cls, pool.world_size, args, kwargs), worker_cls, roles)
