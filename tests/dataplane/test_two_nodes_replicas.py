"""Fully-async GRPO with its two rollout replicas spread over two Ray nodes
(``pipeline.rollout_nodes=2``), each node with a ``/dev/shm`` of its own
(two_nodes_replicas_run.py): one replica on each node, the trainer's rank on node A. With
``dataplane.engine=ray`` it finishes its steps with no payload through the controller and trains
like the same two replicas on one machine; with ``dataplane.engine=shm`` node B's replica is
refused, naming the key. The fast checks of the pool's shape and the refusals are
tests/pipeline/test_rollout_nodes.py."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")  # the run scripts import it at module level

from tests.conftest import ROOT
from tests.dataplane import two_nodes_cluster
from tests.dataplane.test_two_nodes_grpo import ASYNC_ONLY_HERE, run_on_one_machine, without
from tests.dataplane.two_nodes_grpo_run import FULLY_ASYNC
from tests.rl.conftest import assert_same_histories


@pytest.mark.slow  # two raylets (about a minute on 2 loaded cores), two runs there and one reference
def test_fully_async_replicas_spread_over_two_nodes(rl_files, tmp_path):
    pytest.importorskip("ray")
    if two_nodes_cluster.missing():
        pytest.skip(two_nodes_cluster.missing())
    done = subprocess.run(
        [sys.executable, "-m", "tests.dataplane.two_nodes_replicas_run", json.dumps(rl_files), str(tmp_path / "two")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    places, run = result["places"], result["ray"]
    assert len({p["shm_device"] for p in places.values()}) == 2  # two /dev/shm mounts

    replica_ips = [places[node]["ip"] for node in run["replica_nodes"]]
    assert sorted(replica_ips) == [two_nodes_cluster.HEAD, two_nodes_cluster.OTHER]  # one on each node
    assert [places[node]["ip"] for node in run["trainer_nodes"]] == [two_nodes_cluster.HEAD]
    assert [h["step"] for h in run["history"]] == [1, 2]
    assert run["step_bytes"] == [0, 0]  # no Batch serialised or rebuilt by the controller in a step
    assert run["controller_fetched"] == [0, 0]  # nor a store byte fetched by it
    assert run["gen_bytes"] == [0, 0]  # nor a Batch serialised while drawing
    assert run["draws_stored"] == [True, True]  # each draw stayed in the replicas' object stores
    assert all(sum(fetched) > 0 for fetched in run["rank_fetched"])

    assert result["shm_error"].startswith("ValueError"), result["shm_error"]
    assert "dataplane.engine=ray" in result["shm_error"] and "cannot share files" in result["shm_error"]

    one = run_on_one_machine(rl_files, tmp_path / "one", *FULLY_ASYNC, "pipeline.rollout_replicas=2")
    assert_same_histories(without(one, ASYNC_ONLY_HERE), without(run["history"], ASYNC_ONLY_HERE))
    print(f"two-node replicas: shm refused with {result['shm_error']!r}")
