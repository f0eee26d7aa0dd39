"""Two nodes: Ray clusters of two raylets on this machine (``ray.cluster_utils``), so the
per-node placement groups, the ranks' node-local numbering and the cross-node rendezvous run
as on a real cluster. The GRPO step on two nodes of one worker equals the single-worker step
(as two workers on one node do, tests/rl/test_distributed.py). On nodes with addresses of their
own (127.0.0.2 and 127.0.0.3), every rank meets at rank 0's node address, and a fully
asynchronous run trains with its replica on the other node, weights broadcast to it at the
sender's node address (``pipeline.checkpoint_engine.host`` left empty)."""

import json
import os
import subprocess
import sys

import pytest

from tandem.rl import RLTrainer
from tests.conftest import ROOT
from tests.rl.conftest import small_config
from tests.rl.test_distributed import CLOSE, SAME


@pytest.mark.slow  # two raylets (minutes); the Ray group is compared with the local one in the default tier
def test_two_nodes_place_one_rank_each_and_train_like_one_worker(rl_files, tmp_path):
    pytest.importorskip("ray")
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_DEDUP_LOGS": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.controller.multinode_run", json.dumps(rl_files), str(tmp_path / "two")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])

    places = result["places"]
    assert [p["rank"] for p in places] == [0, 1]
    assert places[0]["node"] != places[1]["node"]  # one placement group per node
    assert all(p["local_rank"] == 0 and p["local_world_size"] == 1 for p in places)
    assert all(p["rank_sum"] == 3.0 for p in places)  # the all-reduce crossed the nodes
    assert all(p["master_addr"] == result["node_ip"] for p in places)  # Ray's node address, not a hostname's
    if not result["node_ip"].startswith("127."):  # gloo sent through the interface holding it
        assert result["interface"] is not None
        assert all(p["gloo_interface"] == result["interface"] for p in places)

    apart = result["apart"]
    assert sorted(p["node_ip"] for p in apart) == ["127.0.0.2", "127.0.0.3"]
    assert all(p["master_addr"] == apart[0]["node_ip"] for p in apart)  # rank 0's node, not the caller's
    assert all(p["rank_sum"] == 3.0 for p in apart)

    assert "pool 'default' puts 2 processes on one node, 2 CPUs and 0 GPUs" in result["refusal"]
    assert result["refusal"].count("1 CPUs, 0 GPUs") == 2  # the two one-CPU nodes; the head has none

    (two,) = result["history"]
    (one,) = (
        RLTrainer(small_config(rl_files, tmp_path / "one", "trainer.total_steps=1", "data.val_path="))
        .fit()
        .history
    )
    for name in SAME:
        assert two[name] == one[name], name
    for name in CLOSE:
        assert two[name] == pytest.approx(one[name], rel=1e-4, abs=1e-6), name

    async_steps = result["async"]
    assert [h["step"] for h in async_steps] == [1, 2]
    assert all(h["pipeline/weight_sync_gbps"] > 0 for h in async_steps)
    assert (
        async_steps[0]["rollout_corr/max_abs_log_prob_diff"] < 1e-4
    )  # the replica had the trainer's weights
