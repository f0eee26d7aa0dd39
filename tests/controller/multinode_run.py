"""Run by test_multinode.py in a fresh interpreter: Ray clusters of two nodes on this machine
(``ray.cluster_utils.Cluster``: a head with no CPUs and two nodes of one CPU, each with its own
raylet). On the first, whose nodes share this machine's address: a worker group, a pool that no
node can hold (refused at once) and a GRPO step placed with ``trainer.nnodes=2``. On the second,
whose nodes have addresses of their own (127.0.0.2 and 127.0.0.3, as separate machines would):
a worker group, and a fully asynchronous run whose trainer and rollout replica sit on different
nodes, syncing weights by broadcast — so every rank must dial the right node's address. Prints
one JSON line: where each rank ran, the refusal, the runs' metrics and the nodes' addresses.

Usage: python -m tests.controller.multinode_run FILES_JSON OUTPUT_DIR
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator

import ray
import torch
import torch.distributed as dist
from ray.cluster_utils import Cluster

from tandem.controller import ResourcePool, Worker, create_worker_group, register
from tandem.controller.network import interface_of
from tandem.rl import RLTrainer
from tests.rl.conftest import small_config


class PlacementReporter(Worker):
    """Says where it runs, after an all-reduce across the group (so the rendezvous worked)."""

    @register(dispatch="ONE_TO_ALL")
    def where(self) -> dict:
        self.init_process_group(device="cpu")
        total = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(total)
        info = self.dist_info
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "rank": self.rank,
            "local_rank": self.local_rank,
            "local_world_size": info.local_world_size,
            "master_addr": info.master_addr,
            "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
            "rank_sum": total.item(),
        }


@contextlib.contextmanager
def two_node_cluster(addresses: tuple[str | None, str | None]) -> Iterator[None]:
    """A head with no CPUs and two one-CPU nodes at ``addresses`` (None: this machine's), connected."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for address in addresses:
        cluster.add_node(num_cpus=1, **({"node_ip_address": address} if address else {}))
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        cluster.shutdown()


def main(files: dict, output_dir: str) -> None:
    with two_node_cluster((None, None)):
        with create_worker_group(PlacementReporter, ResourcePool((1, 1)), "ray") as group:
            places = group.where()
        try:  # two processes on one node: neither node has the two CPUs, so Ray could never place it
            create_worker_group(PlacementReporter, ResourcePool((2,)), "ray").shutdown()
            refusal = None
        except ValueError as error:
            refusal = str(error)
        config = small_config(
            files,
            output_dir,
            "trainer.backend=ray",
            "trainer.nnodes=2",
            "dataplane.engine=ray",  # ranks on two nodes: the shm engine is one host's (refused)
            "trainer.n_workers=1",
            "trainer.total_steps=1",
            "data.val_path=",
        )
        history = RLTrainer(config).fit().history
        node_ip = ray.util.get_node_ip_address()
    with two_node_cluster(("127.0.0.2", "127.0.0.3")):
        with create_worker_group(PlacementReporter, ResourcePool((1, 1)), "ray") as group:
            apart = group.where()
        pipeline = small_config(  # the trainer on one node, its rollout replica on the other
            files,
            f"{output_dir}-async",
            "trainer.backend=ray",
            "trainer.total_steps=2",
            "data.val_path=",
            "pipeline.mode=fully_async",
            "pipeline.checkpoint_engine.backend=broadcast",
        )
        async_history = RLTrainer(pipeline).fit().history
    result = {
        "places": places,
        "apart": apart,
        "refusal": refusal,
        "history": history,
        "async": async_history,
        "node_ip": node_ip,
    }
    print(json.dumps({**result, "interface": interface_of(node_ip)}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
