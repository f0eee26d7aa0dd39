"""Run by test_multinode.py in a fresh interpreter: a Ray cluster of two nodes on this machine
(``ray.cluster_utils.Cluster``: a head with no CPUs and two nodes of one CPU, each with its own
raylet), then a worker group, a pool that no node can hold (refused at once), a GRPO step
placed with ``trainer.nnodes=2``, and a fully asynchronous run whose trainer and rollout replica
sit on different nodes, syncing weights by broadcast. Prints one JSON line: where each rank ran,
the refusal, both runs' metrics and the nodes' address.

Usage: python -m tests.controller.multinode_run FILES_JSON OUTPUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

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
            "rank": self.rank,
            "local_rank": self.local_rank,
            "local_world_size": info.local_world_size,
            "master_addr": info.master_addr,
            "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
            "rank_sum": total.item(),
        }


def main(files: dict, output_dir: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
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
            "trainer.n_workers=1",
            "trainer.total_steps=1",
            "data.val_path=",
        )
        history = RLTrainer(config).fit().history
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
        node_ip = ray.util.get_node_ip_address()
        result = {
            "places": places,
            "refusal": refusal,
            "history": history,
            "async": async_history,
            "node_ip": node_ip,
        }
        print(json.dumps({**result, "interface": interface_of(node_ip)}), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
