"""A Ray cluster of two nodes on this machine, each with a ``/dev/shm`` of its own, as two hosts
would be: node A (the head, with the driver) at 127.0.0.2 and node B at 127.0.0.3, B's raylet
in its own mount namespace (``unshare -m``) with a fresh tmpfs mounted on ``/dev/shm`` for it
and everything it starts. Shared by the two-node tests (``tests/dataplane/*two_nodes*``) and
``bench/data_plane.py --two-nodes``.

Needs root (to mount the tmpfs) and ``unshare``: :func:`missing` says what is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
RAY = str(Path(sys.executable).with_name("ray"))
HEAD, OTHER = "127.0.0.2", "127.0.0.3"
START_TIMEOUT_S = 180.0  # a raylet takes about a minute on a loaded 2-core machine


def missing() -> str:
    """Why this machine cannot build the cluster (empty when it can)."""
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    if os.geteuid() != 0:
        return "needs the right to mount a tmpfs on /dev/shm (root)"
    return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HEAD, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def two_nodes(
    cpus: float = 1,
    object_store_bytes: int = 80_000_000,
    shm_size: str = "256m",
    env_vars: dict | None = None,
) -> Iterator[str]:
    """Start node A and node B (``cpus`` each), connect this process as the driver on node A, and
    yield the cluster's address; everything is stopped and removed on exit.

    Each node gets a temporary directory of its own: ``ray start`` records the cluster's address
    in its temporary directory, and in the default one (``/tmp/ray``) every later ``ray.init()``
    on this machine would connect to this cluster instead of starting its own. ``env_vars`` go to
    the raylets and to the driver's job (its workers), beside ``PYTHONPATH``.
    """
    import ray

    port = free_port()
    temp = tempfile.mkdtemp(prefix="tdp-", dir="/tmp")  # short: Ray's socket paths live below it
    extra = {"PYTHONPATH": ROOT, **(env_vars or {})}
    env = {**os.environ, **extra, "RAY_DEDUP_LOGS": "0", "RAY_AUTH_MODE": "disabled"}
    os.environ["RAY_AUTH_MODE"] = "disabled"  # the driver, too
    common = [f"--num-cpus={cpus:g}", f"--object-store-memory={object_store_bytes}", "--block",
              "--disable-usage-stats"]  # fmt: skip
    head = subprocess.Popen(
        [RAY, "start", "--head", f"--node-ip-address={HEAD}", f"--port={port}", "--include-dashboard=false",
         f"--temp-dir={temp}/a", *common],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    other = None
    try:
        address = f"{HEAD}:{port}"
        wait_for(lambda: os.path.exists(f"{temp}/a/ray_current_cluster"), "the head node did not start")
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
        mount = f"mount -t tmpfs -o size={shm_size} tmpfs /dev/shm"
        other = subprocess.Popen(
            ["unshare", "-m", "sh", "-c", f"{mount} && exec {start_b}"],
            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        ray.init(address=address, _node_ip_address=HEAD, log_to_driver=False,
                 runtime_env={"env_vars": extra})  # fmt: skip
        wait_for(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2, "node B did not join")
        yield address
    finally:
        ray.shutdown()
        for process in (other, head):
            if process is not None:
                _stop(process)
        shutil.rmtree(temp, ignore_errors=True)


def _stop(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=20)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the two-node Ray cluster: {what} within {timeout_s:.0f} s")
        time.sleep(0.5)


def _where() -> dict:
    import ray

    return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
            "shm_device": os.stat("/dev/shm").st_dev}  # fmt: skip


def node_places() -> dict[str, dict]:
    """Each alive node's ``{"node", "ip", "shm_device"}`` by node id, as a task pinned to that node
    sees them (its IP, and the device of the ``/dev/shm`` its processes see)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    where = ray.remote(num_cpus=0)(_where)
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    places = ray.get(
        [
            where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
            for n in nodes
        ]
    )
    return {place["node"]: place for place in places}
