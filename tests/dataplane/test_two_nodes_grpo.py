"""GRPO on two Ray nodes, each with a ``/dev/shm`` of its own (two_nodes_grpo_run.py), with
``dataplane.enabled=true dataplane.engine=ray``: in sync mode two trainer ranks, one per node; in
fully-async mode the trainer on one node and its rollout replica on the other. Both finish their
steps with no payload serialised by the controller in a step's stage calls, and train like the
same config on one machine (process ranks, the ``shm`` engine): sync GRPO on two gloo ranks
exactly, step for step; fully-async as close as its own reference comparison allows (see
:data:`ASYNC_ONLY_HERE`)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")  # the run scripts import it at module level

from tests.conftest import ROOT
from tests.dataplane import two_nodes_cluster
from tests.dataplane.two_nodes_grpo_run import FULLY_ASYNC, STEPS
from tests.rl.conftest import assert_same_histories, small_config
from tests.rl.test_dataplane_step import CountingTrainer, assert_equal_metrics

ON_ONE_MACHINE = ("dataplane.enabled=true",)  # process ranks, the shm engine
# What a fully-async run measures of its own pace (how deep the queue was and how many bytes waited
# in it when the step drew: the replica's pace against the trainer's, which differs between any two
# runs, on one machine too), and of its store (a Ray block's bytes are not a shared-memory block's).
# The wall-clock metrics (``*_s``, ``*_gbps``) are left out by the comparison itself.
ASYNC_ONLY_HERE = ("pipeline/queue_depth", "pipeline/inflight_bytes")


def run_on_one_machine(rl_files, out, *overrides):
    trainer = CountingTrainer(
        small_config(rl_files, out, "data.val_path=", STEPS, *ON_ONE_MACHINE, *overrides)
    )
    return trainer.fit().history


def without(history, prefixes):
    return [{k: v for k, v in step.items() if not k.startswith(prefixes)} for step in history]


@pytest.mark.slow  # two raylets (about a minute on 2 loaded cores) and four 2-step runs
def test_grpo_sync_and_fully_async_across_two_nodes_with_private_shm(rl_files, tmp_path):
    pytest.importorskip("ray")
    if two_nodes_cluster.missing():
        pytest.skip(two_nodes_cluster.missing())
    done = subprocess.run(
        [sys.executable, "-m", "tests.dataplane.two_nodes_grpo_run", json.dumps(rl_files), str(tmp_path / "two")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    places = result["places"]  # by node id
    assert sorted(p["ip"] for p in places.values()) == [two_nodes_cluster.HEAD, two_nodes_cluster.OTHER]
    assert len({p["shm_device"] for p in places.values()}) == 2  # two /dev/shm mounts

    sync, fully_async = result["sync"], result["fully_async"]
    assert sorted(places[n]["ip"] for n in sync["trainer_nodes"]) == ["127.0.0.2", "127.0.0.3"]
    (trainer_node,), (replica_node,) = fully_async["trainer_nodes"], fully_async["replica_nodes"]
    assert (places[trainer_node]["ip"], places[replica_node]["ip"]) == ("127.0.0.2", "127.0.0.3")
    for run in (sync, fully_async):
        assert [h["step"] for h in run["history"]] == [1, 2]  # finished its steps
        assert run["step_bytes"] == [0, 0]  # no Batch serialised or rebuilt by the controller in a step
        assert all(sum(fetched) > 0 for fetched in run["rank_fetched"])  # the ranks fetched their rows
        assert run["draws_stored"] == [True, True]  # each step's draw stayed where it was generated

    one = run_on_one_machine(rl_files, tmp_path / "one-sync", "trainer.n_workers=2")
    assert_equal_metrics(one, sync["history"])  # two gloo ranks on two nodes = two on one, exactly
    one_async = run_on_one_machine(rl_files, tmp_path / "one-async", *FULLY_ASYNC)
    assert_same_histories(
        without(one_async, ASYNC_ONLY_HERE), without(fully_async["history"], ASYNC_ONLY_HERE)
    )
    wire = [
        f"{sum(f) / t:.1f}"
        for run in (sync, fully_async)
        for f, t in zip(run["rank_fetched"], run["real_tokens"], strict=True)
    ]
    print(f"ranks' wire bytes per real response token, sync then fully-async steps: {wire}; "
          f"store bytes the controller fetched: {sync['controller_fetched']}, {fully_async['controller_fetched']}")  # fmt: skip
