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
# Assignments the exact packing search tries before it gives up and leaves the answer to Ray.
PACKING_SEARCH_LIMIT = 100_000


def pool_demand(pool: ResourcePool) -> dict[str, float]:
    """What the whole pool reserves: ``{"CPU": ..., "GPU": ...}``."""
    per_process = {"CPU": pool.cpus_per_process, "GPU": pool.gpus_per_process}
    return {kind: per_process[kind] * pool.world_size for kind in RESOURCES}


def check_cluster_holds(pools: Sequence[ResourcePool], nodes: Sequence[Mapping[str, float]]) -> None:
    """Raise ``ValueError`` when no placement on ``nodes`` could hold ``pools`` at once.

    Each node-share of a pool (its ``processes_per_node[i]`` processes, one bundle of the pool's
    Ray placement group) must go whole onto some node, the shares of one pool onto distinct nodes,
    and all shares at once. Checked in order, each with its own message: the pools' CPUs and GPUs
    in all against the cluster's; each pool's node count against the alive nodes; every share
    against the largest node; then an exact search for an assignment of all shares
    to nodes (:func:`shares_pack`), which finds, for instance, that three 5-GPU pools do not fit
    on two 8-GPU nodes although 15 <= 16.

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
        if len(pool.processes_per_node) > len(nodes):
            raise ValueError(
                f"pool {pool.name!r} spans {len(pool.processes_per_node)} nodes (processes per node "
                f"{pool.processes_per_node}), each node's share on a node of its own, and the Ray cluster "
                f"has {len(nodes)} alive node(s): {_describe(nodes)}"
            )
    shares = [
        (index, pool.name, count, share)
        for index, pool in enumerate(pools)
        for count, share in zip(pool.processes_per_node, pool.node_shares(), strict=True)
    ]
    for _, name, count, share in shares:
        if not any(_fits(share, node) for node in nodes):
            raise ValueError(
                f"pool {name!r} puts {count} processes on one node, {share['CPU']:g} CPUs and "
                f"{share['GPU']:g} GPUs in all, and no alive node of the Ray cluster has that much: "
                f"{_describe(nodes)}"
            )
    if not shares_pack([share for *_, share in shares], nodes, [index for index, *_ in shares]):
        listed = ", ".join(
            f"{name} {count} process(es) ({share['CPU']:g} CPUs, {share['GPU']:g} GPUs)"
            for _, name, count, share in shares
        )
        raise ValueError(
            "the pools fit the Ray cluster in total but cannot be placed together: each node-share "
            "of a pool goes whole onto one node, the shares of one pool onto distinct nodes, and no "
            f"assignment of the shares [{listed}] to the alive nodes holds them all: {_describe(nodes)}"
        )


def _fits(share: Mapping[str, float], room: Mapping[str, float]) -> bool:
    return all(room.get(kind, 0.0) + 1e-9 >= share.get(kind, 0.0) for kind in RESOURCES)


def shares_pack(
    shares: Sequence[Mapping[str, float]],
    nodes: Sequence[Mapping[str, float]],
    owners: Sequence[int] | None = None,
) -> bool:
    """Whether every share can go whole onto a node with all of them placed at once.

    A depth-first search over assignments, largest share first, that tries one node of each
    distinct room left (nodes with equal room and the same owners placed are interchangeable).
    Exact, unless it passes :data:`PACKING_SEARCH_LIMIT` assignments: then it answers True and
    leaves the verdict to Ray.

    Args:
        shares: what each share reserves, e.g. ``{"CPU": 4.0, "GPU": 4.0}``.
        nodes: each node's total resources.
        owners: the pool each share belongs to; two shares of one pool never share a node (Ray
            spreads a pool's node bundles, :func:`~tandem.controller.ray_group.placement_bundles`).
            ``None``: no such constraint.
    """
    owned = list(owners) if owners is not None else list(range(len(shares)))
    order = sorted(
        zip(shares, owned, strict=True),
        key=lambda item: (item[0].get("GPU", 0.0), item[0].get("CPU", 0.0)),
        reverse=True,
    )
    room = [{kind: node.get(kind, 0.0) for kind in RESOURCES} for node in nodes]
    placed_owners: list[set[int]] = [set() for _ in nodes]
    tries = 0

    def place(index: int) -> bool:
        nonlocal tries
        if index == len(order):
            return True
        (share, owner), seen = order[index], set()
        for left, there in zip(room, placed_owners, strict=True):
            key = (tuple(round(left[kind], 6) for kind in RESOURCES), frozenset(there))
            if key in seen or owner in there or not _fits(share, left):
                continue
            seen.add(key)
            tries += 1
            if tries > PACKING_SEARCH_LIMIT:
                return True
            _take(left, share, -1.0)
            there.add(owner)
            placed = place(index + 1)
            there.discard(owner)
            _take(left, share, 1.0)
            if placed:
                return True
        return False

    return place(0)


def _take(room: dict[str, float], share: Mapping[str, float], sign: float) -> None:
    for kind in RESOURCES:
        room[kind] += sign * share.get(kind, 0.0)


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
