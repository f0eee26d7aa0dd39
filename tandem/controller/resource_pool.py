"""``ResourcePool``: how many worker processes a group runs on each node, and what each one gets."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.validation import check_positive, check_range


@dataclass(frozen=True)
class ResourcePool:
    """Worker processes per node and the CPUs/GPUs reserved for each.

    Attributes:
        processes_per_node: e.g. ``(8, 8)`` for two nodes of eight workers; rank order follows it.
        cpus_per_process: CPUs reserved per worker (Ray placement bundles; fractions allowed).
        gpus_per_process: GPUs reserved per worker (0 on CPU machines).
        name: the pool's name in a role -> pool mapping.
    """

    processes_per_node: tuple[int, ...] = (1,)
    cpus_per_process: float = 1.0
    gpus_per_process: float = 0.0
    name: str = "default"

    def __post_init__(self) -> None:
        if not self.processes_per_node or any(n < 1 for n in self.processes_per_node):
            raise ValueError(
                f"resource_pool.processes_per_node={self.processes_per_node!r} needs positive counts"
            )
        check_positive("resource_pool", "cpus_per_process", self.cpus_per_process)
        check_range("resource_pool", "gpus_per_process", self.gpus_per_process, low=0.0)

    @property
    def world_size(self) -> int:
        return sum(self.processes_per_node)

    def node_shares(self) -> list[dict[str, float]]:
        """What each node's share of the pool reserves in all, in node order: ``{"CPU": ...,
        "GPU": ...}`` (one Ray placement bundle a node; the shares go on distinct nodes)."""
        return [
            {"CPU": self.cpus_per_process * count, "GPU": self.gpus_per_process * count}
            for count in self.processes_per_node
        ]

    def node_and_local_rank(self, rank: int) -> tuple[int, int]:
        """Which node a global rank lives on and its rank there."""
        for node, count in enumerate(self.processes_per_node):
            if rank < count:
                return node, rank
            rank -= count
        raise IndexError(f"rank is outside a pool of world size {self.world_size}")
