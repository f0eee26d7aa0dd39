"""Run by test_two_nodes_grpo.py in a fresh interpreter: GRPO on a Ray cluster of two nodes on
this machine, each with a ``/dev/shm`` of its own (:mod:`tests.dataplane.two_nodes_cluster`),
with ``dataplane.enabled=true dataplane.engine=ray``:

* ``sync``: two trainer ranks, ``trainer.nnodes=2``, one on each node;
* ``fully_async``: the trainer's rank on node A and its rollout replica on node B, whose
  ``/dev/shm`` the controller does not see (each node has one CPU and each process reserves one;
  node B's is held while the trainer is placed, so that the replica gets it).

Prints one JSON line: every node's IP and ``/dev/shm`` device, and for each run its metrics, the
node of every trainer rank and replica, the payload bytes the controller serialised in each
step's stage calls, the store bytes it fetched, and what the ranks fetched against the step's
real response tokens.

Usage: python -m tests.dataplane.two_nodes_grpo_run FILES_JSON OUTPUT_DIR
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from tandem.dataplane import BatchRef, traffic
from tests.dataplane.two_nodes_cluster import OTHER, node_places, two_nodes
from tests.rl.conftest import small_config
from tests.rl.test_dataplane_step import CountingTrainer

ON_RAY = ("trainer.backend=ray", "dataplane.enabled=true", "dataplane.engine=ray")
SYNC = ("trainer.nnodes=2", "trainer.n_workers=1")
FULLY_ASYNC = (
    "trainer.n_workers=1",
    "pipeline.mode=fully_async",
    "pipeline.staleness_threshold=0",  # one replica, no group in flight across a sync: deterministic
    "pipeline.partial_rollout=false",
    "pipeline.checkpoint_engine.backend=broadcast",  # the replica's node does not see the trainer's files
    "pipeline.trainer_threads=1",
    "pipeline.rollout_threads=1",
)
STEPS = "trainer.total_steps=2"


class PlacedTrainer(CountingTrainer):
    """Also notes, each step, the node of every trainer rank and rollout replica, and the store
    bytes the trainer's ranks fetched against the step's real response tokens."""

    def __init__(self, *args, hold: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hold = hold  # a node's IP whose CPU is held while the trainer's workers are placed
        self.trainer_nodes: list[str] = []
        self.replica_nodes: list[str] = []
        self.rank_fetched: list[list[int]] = []
        self.real_tokens: list[int] = []

    def _start_workers(self, groups):
        with holding(self.hold) if self.hold else contextlib.nullcontext():
            return super()._start_workers(groups)

    def train_step(self):
        group = getattr(self.workers, "group", self.workers)
        self.trainer_nodes = list(group.backend.nodes)
        replicas = getattr(self.rollout, "replicas", None)
        if replicas is not None:
            self.replica_nodes = list(replicas.backend.nodes)
        before = group.data_traffic()
        metrics = super().train_step()
        after = group.data_traffic()
        self.rank_fetched.append(
            [(a - b).fetched_bytes + (a - b).fetched_index_bytes for a, b in zip(after, before, strict=True)]
        )
        self.real_tokens.append(real_response_tokens(self.views[-1]))
        return metrics


def real_response_tokens(view) -> int:
    """The step's sampled tokens, from the controller's per-row scalars (or its mask, if it holds one)."""
    if "response_mask" in view:
        return int(view["response_mask"].sum())
    return int(torch.as_tensor(view["response_length"]).sum())


@contextlib.contextmanager
def holding(ip: str) -> Iterator[None]:
    """Node ``ip``'s CPU reserved (a placement group pinned there by its ``node:<ip>`` resource)."""
    held = placement_group([{"CPU": 1, f"node:{ip}": 0.001}], strategy="STRICT_PACK")
    ray.get(held.ready(), timeout=60)
    try:
        yield
    finally:
        remove_placement_group(held)


def run(files: dict, out: Path, *overrides: str, hold: str = "", trainer_class: type = PlacedTrainer) -> dict:
    config = small_config(files, out, "data.val_path=", STEPS, *ON_RAY, *overrides)
    trainer = trainer_class(config, hold=hold)
    before = traffic()
    history = trainer.fit().history
    return {
        "history": history,
        "trainer_nodes": trainer.trainer_nodes,
        "replica_nodes": trainer.replica_nodes,
        "step_bytes": trainer.step_bytes,
        "gen_bytes": trainer.gen_bytes,
        "controller_fetched": trainer.own_fetched,
        "controller_fetched_run": (traffic() - before).fetched_bytes,
        "rank_fetched": trainer.rank_fetched,
        "real_tokens": trainer.real_tokens,
        "left": trainer.left,
        "draws_stored": [isinstance(draw, BatchRef) for draw in trainer.draws],
    }


def main() -> None:
    files, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    with two_nodes(env_vars={"OMP_NUM_THREADS": "1"}):
        places = node_places()
        result = {
            "places": places,
            "sync": run(files, out / "sync", *SYNC),
            "fully_async": run(files, out / "fully_async", *FULLY_ASYNC, hold=OTHER),
        }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
