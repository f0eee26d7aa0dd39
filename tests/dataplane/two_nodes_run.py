"""Run by test_two_nodes.py in a fresh interpreter: a Ray cluster of two nodes on this machine
whose second raylet has a ``/dev/shm`` of its own (``unshare -m`` and a fresh tmpfs mounted on
``/dev/shm`` for that raylet and everything it starts), at 127.0.0.2 (node A, with the driver)
and 127.0.0.3 (node B), as two hosts would be. A worker group of one rank per node puts its
stage outputs into Ray's object store; the next stage hands each rank the other rank's rows,
so each fetches a block from the other node through Ray; a block's shared-memory file is not
visible on the other node. Prints one JSON line.

Usage: python -m tests.dataplane.two_nodes_run
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import ray
import torch

from tandem.controller import ResourcePool, Worker, create_worker_group, register
from tandem.dataplane import BatchRef, DataPlaneConfig, ShmStore, get, traffic
from tandem.protocol import Batch
from tandem.protocol.traffic import batch_traffic

ROOT = str(Path(__file__).resolve().parents[2])
RAY = str(Path(sys.executable).with_name("ray"))
HEAD, OTHER = "127.0.0.2", "127.0.0.3"
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HEAD, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def two_nodes() -> Iterator[str]:
    """Start the head (node A) and node B, B in its own mount namespace with a private /dev/shm.

    Each node gets a temporary directory of its own: ``ray start`` records the cluster's address
    in its temporary directory, and in the default one (``/tmp/ray``) every later ``ray.init()``
    on this machine would connect to this cluster instead of starting its own.
    """
    port = free_port()
    temp = tempfile.mkdtemp(prefix="tdp-", dir="/tmp")  # short: Ray's socket paths live below it
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_DEDUP_LOGS": "0", "RAY_AUTH_MODE": "disabled"}
    os.environ["RAY_AUTH_MODE"] = "disabled"  # the driver, too
    common = ["--num-cpus=1", "--object-store-memory=80000000", "--block", "--disable-usage-stats"]
    head = subprocess.Popen(
        [RAY, "start", "--head", f"--node-ip-address={HEAD}", f"--port={port}", "--include-dashboard=false",
         f"--temp-dir={temp}/a", *common],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    other = None
    try:
        address = f"{HEAD}:{port}"
        _wait_for(lambda: os.path.exists(f"{temp}/a/ray_current_cluster"))
        start_b = " ".join(
            [
                RAY,
                "start",
                f"--address={address}",
                f"--node-ip-address={OTHER}",
                f"--temp-dir={temp}/b",
                *common,
            ]
        )
        other = subprocess.Popen(
            ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=256m tmpfs /dev/shm && exec {start_b}"],
            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        ray.init(address=address, _node_ip_address=HEAD, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT}})  # fmt: skip
        _wait_for(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2)
        yield address
    finally:
        ray.shutdown()
        for process in (other, head):
            if process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=20)
        shutil.rmtree(temp, ignore_errors=True)


def _wait_for(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the two-node Ray cluster did not come up")
        time.sleep(0.5)


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
