"""Run by test_two_nodes.py in a fresh interpreter: a Ray cluster of two nodes on this machine
whose second raylet has a ``/dev/shm`` of its own, at 127.0.0.2 (node A, with the driver) and
127.0.0.3 (node B), as two hosts would be (:mod:`tests.dataplane.two_nodes_cluster`). A worker
group of one rank per node puts its stage outputs into Ray's object store; the next stage hands
each rank the other rank's rows, so each fetches a block from the other node through Ray; a
block's shared-memory file is not visible on the other node. Prints one JSON line.

Usage: python -m tests.dataplane.two_nodes_run
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ray
import torch

from tandem.controller import ResourcePool, Worker, create_worker_group, register
from tandem.dataplane import BatchRef, DataPlaneConfig, ShmStore, get, traffic
from tandem.protocol import Batch
from tandem.protocol.traffic import batch_traffic
from tests.dataplane.two_nodes_cluster import two_nodes

ROWS, WIDTH = 6, 40


def tokens_of(seeds: list[int]) -> torch.Tensor:
    """``[B, WIDTH]`` right-padded int64 token ids, row ``i`` from ``seeds[i]`` (the reference)."""
    out = torch.zeros(len(seeds), WIDTH, dtype=torch.int64)
    for i, seed in enumerate(seeds):
        gen = torch.Generator().manual_seed(seed)
        length = int(torch.randint(1, WIDTH + 1, (1,), generator=gen))
        out[i, :length] = torch.randint(1, 1 << 20, (length,), generator=gen)
    return out


class NodeWorker(Worker):
    """A rank that generates token rows from per-row seeds and later copies the rows it is given."""

    @register(dispatch="DP_COMPUTE", reads=("seed",), outputs="ref")
    def generate(self, batch: Batch) -> Batch:
        tokens = tokens_of([int(s) for s in batch["seed"]])
        return Batch({"responses": tokens, "rollout_log_probs": -tokens.float() / (1 << 20)})

    @register(dispatch="DP_COMPUTE", reads=("responses", "rollout_log_probs"), outputs="ref")
    def copy_rows(self, batch: Batch) -> Batch:
        return Batch({"copied": batch["responses"], "copied_log_probs": batch["rollout_log_probs"]})

    @register(dispatch="ONE_TO_ALL")
    def where(self) -> dict:
        shm = ShmStore()
        block = shm.put({"probe": torch.ones(1, 4)})  # a file in this node's /dev/shm
        return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "shm_file": block.path, "shm_device": os.stat("/dev/shm").st_dev}  # fmt: skip

    @register(dispatch="ONE_TO_ALL")
    def sees(self, paths: list[str]) -> list[bool]:
        return [os.path.exists(p) for p in paths]

    @register(dispatch="ONE_TO_ALL")
    def remove(self, paths: list[str]) -> None:
        for p in paths:
            Path(p).unlink(missing_ok=True)


def main() -> None:
    with two_nodes():
        group = create_worker_group(NodeWorker, ResourcePool((1, 1), cpus_per_process=1), "ray")
        try:
            group.use_data_store(DataPlaneConfig(engine="ray"))
            places = group.where()
            files = [p["shm_file"] for p in places]
            visible = group.sees(files)  # rank r sees [file of rank 0, file of rank 1]
            group.remove(files)

            seeds = list(range(100, 100 + ROWS))
            prompts = BatchRef(Batch(non_tensors={"seed": seeds}), (), {})
            before_batches, before_store, before_ranks = batch_traffic(), traffic(), group.data_traffic()
            generated = group.generate(prompts)  # rank 0's rows in a block on its node, rank 1's on its
            swapped = generated.reorder([3, 4, 5, 0, 1, 2])  # each rank now reads the other node's block
            copied = group.copy_rows(swapped)
            after_ranks = group.data_traffic()
            handled = batch_traffic() - before_batches
            controller_fetched = (traffic() - before_store).fetched_bytes

            got = copied.materialise(get)  # the check, after the window: the driver fetches the result
            expected = tokens_of([seeds[i] for i in [3, 4, 5, 0, 1, 2]])
            exact = torch.equal(got["copied"], expected) and torch.equal(
                got["copied_log_probs"], -expected.float() / (1 << 20)
            )
            blocks = generated.blocks()
            result = {
                "places": places,
                "visible": visible,
                "block_nodes": [b.node_id for b in blocks],
                "engines": sorted({b.engine for b in blocks + copied.blocks()}),
                "exact": bool(exact),
                "controller_batch_bytes": handled.total,
                "controller_fetched_bytes": controller_fetched,
                "fetched": [(a - b).fetched_bytes for a, b in zip(after_ranks, before_ranks, strict=True)],
                # int32 ids and fp32 log-probs of each rank's rows' real tokens (the pads are not sent)
                "expected_fetched": [8 * int((expected[rows] != 0).sum()) for rows in ([0, 1, 2], [3, 4, 5])],
            }
        finally:
            group.shutdown()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
