"""Whether a Ray cluster can ever hold a set of pools, checked before any placement group waits.

Ray queues a placement group that does not fit and waits for resources that may never come;
without this check a run asking for GPUs on a CPU-only cluster would sit out the placement
timeout before saying so. The check reads the resources of the nodes alive now: a cluster
that an autoscaler grows on demand must have the nodes up first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tandem.controller.resource_pool import ResourcePool

RESOURCES = ("CPU", "GPU")


def pool_demand(pool: ResourcePool) -> dict[str, float]:
    """What the whole pool reserves: ``{"CPU": ..., "GPU": ...}``."""
    per_process = {"CPU": pool.cpus_per_process, "GPU": pool.gpus_per_process}
    return {kind: per_process[kind] * pool.world_size for kind in RESOURCES}


def check_cluster_holds(pools: Sequence[ResourcePool], nodes: Sequence[Mapping[str, float]]) -> None:
    """Raise ``ValueError`` when no placement on ``nodes`` could hold ``pools`` at once.

    Two things are checked: the pools' CPUs and GPUs in all against the cluster's, and every
    node-share of a pool (its ``processes_per_node[i]`` processes, which go on one node)
    against the largest node. Placements that pass both yet cannot be packed together are
    left to Ray and its placement timeout.

    Args:
        pools: the pools that will be placed together.
        nodes: each alive node's total resources, e.g. ``{"CPU": 16.0, "GPU": 8.0}``.
    """
    have = {kind: sum(node.get(kind, 0.0) for node in nodes) for kind in RESOURCES}
    want = {kind: sum(pool_demand(pool)[kind] for pool in pools) for kind in RESOURCES}
    for kind in RESOURCES:
        if want[kind] > have[kind] + 1e-9:
            parts = ", ".join(
                f"{pool.name} {pool_demand(pool)[kind]:g}" for pool in pools if pool_demand(pool)[kind]
            )
            raise ValueError(
                f"the run needs {want[kind]:g} {kind}s ({parts}) and the Ray cluster has {have[kind]:g} "
                f"on {len(nodes)} alive node(s): {_describe(nodes)}"
            )
    for pool in pools:
        for count in sorted(set(pool.processes_per_node), reverse=True):
            share = {"CPU": pool.cpus_per_process * count, "GPU": pool.gpus_per_process * count}
            if not any(
                all(node.get(kind, 0.0) + 1e-9 >= share[kind] for kind in RESOURCES) for node in nodes
            ):
                raise ValueError(
                    f"pool {pool.name!r} puts {count} processes on one node, {share['CPU']:g} CPUs and "
                    f"{share['GPU']:g} GPUs in all, and no alive node of the Ray cluster has that much: "
                    f"{_describe(nodes)}"
                )


def alive_node_resources(ray: Any) -> list[dict[str, float]]:
    """The total CPUs and GPUs of each node of the connected Ray cluster that is alive now."""
    return [
        {kind: float(node["Resources"].get(kind, 0.0)) for kind in RESOURCES}
        for node in ray.nodes()
        if node.get("Alive")
    ]


def check_ray_cluster_holds(pools: Sequence[ResourcePool], ray: Any) -> None:
    """:func:`check_cluster_holds` against the connected cluster's alive nodes."""
    check_cluster_holds(pools, alive_node_resources(ray))


def _describe(nodes: Sequence[Mapping[str, float]]) -> str:
    return (
        "; ".join(
            f"node {i}: {node.get('CPU', 0.0):g} CPUs, {node.get('GPU', 0.0):g} GPUs"
            for i, node in enumerate(nodes)
        )
        or "no nodes"
    )
