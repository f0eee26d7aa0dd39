"""Run by test_two_nodes_replicas.py in a fresh interpreter: fully-async GRPO on the two-node Ray
cluster of this machine (:mod:`tests.dataplane.two_nodes_cluster`, two CPUs a node), with
``pipeline.rollout_replicas=2 pipeline.rollout_nodes=2``: the trainer's rank on node A (both of
node B's CPUs are held while it is placed) and one replica on each node, spread by the rollout
pool's placement group.

Two runs: with ``dataplane.engine=ray`` (each replica keeps its groups in its own node's object
store) to the end, and with ``dataplane.engine=shm``, which must be refused when the replicas
start, naming ``dataplane.engine`` (node B's replica cannot share files with the controller).

Prints one JSON line: every node's IP and ``/dev/shm`` device, the ray run's result (as
:func:`tests.dataplane.two_nodes_grpo_run.run` reports it) and the shm run's error.

Usage: python -m tests.dataplane.two_nodes_replicas_run FILES_JSON OUTPUT_DIR
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from tests.dataplane.two_nodes_cluster import OTHER, node_places, two_nodes
from tests.dataplane.two_nodes_grpo_run import FULLY_ASYNC, PlacedTrainer, run

CPUS_PER_NODE = 2  # node A: the trainer's rank and replica 0; node B: replica 1
SPREAD = ("pipeline.rollout_replicas=2", "pipeline.rollout_nodes=2")


@contextlib.contextmanager
def holding_all_of(ip: str) -> Iterator[None]:
    """Every CPU of node ``ip`` reserved, so that the trainer's rank goes onto the other node."""
    held = placement_group([{"CPU": CPUS_PER_NODE, f"node:{ip}": 0.001}], strategy="STRICT_PACK")
    ray.get(held.ready(), timeout=60)
    try:
        yield
    finally:
        remove_placement_group(held)


class TrainerOnNodeA(PlacedTrainer):
    def _start_workers(self, groups):
        with holding_all_of(OTHER):
            return super()._start_workers(groups)


def main() -> None:
    files, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    with two_nodes(cpus=CPUS_PER_NODE, env_vars={"OMP_NUM_THREADS": "1"}):
        ray_run = run(files, out / "ray", *FULLY_ASYNC, *SPREAD, trainer_class=TrainerOnNodeA)
        result = {"places": node_places(), "ray": ray_run}
        try:
            run(
                files,
                out / "shm",
                *FULLY_ASYNC,
                *SPREAD,
                "dataplane.engine=shm",
                trainer_class=TrainerOnNodeA,
            )
            result["shm_error"] = ""
        except Exception as error:  # noqa: BLE001 - the test checks its type and message
            result["shm_error"] = f"{type(error).__name__}: {error}"
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
