"""Placements that could never be held are refused at once, naming the pools and the keys, on a
real Ray cluster and on this machine; placements that fit are not refused."""

import time

import pytest
import torch

from tandem.controller import ResourcePool, check_placement, create_worker_group
from tandem.controller.ray_capacity import alive_node_resources, check_cluster_holds
from tests.controller.workers import EchoWorker

EIGHT_GPUS = {"CPU": 32.0, "GPU": 8.0}


def pool(per_node, gpus=1.0, cpus=1.0, name="actor"):
    return ResourcePool(tuple(per_node), cpus_per_process=cpus, gpus_per_process=gpus, name=name)


def first_fit(pools, nodes):
    """The reference: place every node-share of every pool, largest first, on the node with the
    most room left; True when all of them went somewhere. For the small cases below, a share
    that this greedy cannot place cannot be placed at all."""
    room = [dict(node) for node in nodes]
    shares = [
        {"CPU": p.cpus_per_process * n, "GPU": p.gpus_per_process * n}
        for p in pools
        for n in p.processes_per_node
    ]
    for share in sorted(shares, key=lambda s: (s["GPU"], s["CPU"]), reverse=True):
        fits = [r for r in room if all(r.get(k, 0.0) + 1e-9 >= v for k, v in share.items())]
        if not fits:
            return False
        target = max(fits, key=lambda r: (r.get("GPU", 0.0), r.get("CPU", 0.0)))
        for k, v in share.items():
            target[k] = target.get(k, 0.0) - v
    return True


CASES = [
    ([pool([8])], [EIGHT_GPUS]),
    ([pool([8, 8])], [EIGHT_GPUS, EIGHT_GPUS]),
    ([pool([4]), pool([4], name="critic")], [EIGHT_GPUS]),
    ([pool([4, 4]), pool([2], name="rollout")], [EIGHT_GPUS, EIGHT_GPUS]),
    (
        [pool([2], gpus=0.5), pool([3], gpus=0.5, name="rollout")],
        [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 1.0}],
    ),
    ([pool([1], gpus=0.0, cpus=2.0)], [{"CPU": 2.0}]),
]


@pytest.mark.parametrize("pools,nodes", CASES)
def test_placements_that_fit_are_not_refused(pools, nodes):
    assert first_fit(pools, nodes)
    check_cluster_holds(pools, nodes)


REFUSED = [
    ([pool([9])], [EIGHT_GPUS], "needs 9 GPUs (actor 9) and the Ray cluster has 8"),
    ([pool([8]), pool([1], name="rollout")], [EIGHT_GPUS], "needs 9 GPUs (actor 8, rollout 1)"),
    ([pool([1])], [{"CPU": 8.0}], "needs 1 GPUs (actor 1) and the Ray cluster has 0"),
    ([pool([8])], [{"CPU": 8.0, "GPU": 4.0}] * 2, "pool 'actor' puts 8 processes on one node"),
    (
        [pool([2], gpus=0.0)],
        [{"CPU": 1.0}, {"CPU": 1.0}],
        "pool 'actor' puts 2 processes on one node, 2 CPUs",
    ),
    ([pool([1])], [], "on 0 alive node(s): no nodes"),
]


@pytest.mark.parametrize("pools,nodes,message", REFUSED)
def test_placements_that_cannot_fit_are_refused_naming_the_pools(pools, nodes, message):
    assert not first_fit(pools, nodes)
    with pytest.raises(ValueError) as error:
        check_cluster_holds(pools, nodes)
    assert message in str(error.value)


def test_ray_refuses_a_gpu_pool_on_a_cpu_cluster_at_once(ray_cluster):
    """Before the check, this waited out the 60 s placement timeout."""
    nodes = alive_node_resources(ray_cluster)
    assert sum(n["CPU"] for n in nodes) == ray_cluster.cluster_resources()["CPU"]
    if any(n["GPU"] for n in nodes):
        pytest.skip("the cluster has GPUs")
    start = time.monotonic()
    with pytest.raises(ValueError, match="needs 1 GPUs \\(actor 1\\) and the Ray cluster has 0"):
        create_worker_group(EchoWorker, pool([1]), "ray")
    with pytest.raises(ValueError, match="the pools follow trainer.n_gpus_per_node"):
        check_placement([pool([1])], "ray", "trainer.n_gpus_per_node")
    assert time.monotonic() - start < 20.0
    with create_worker_group(EchoWorker, pool([2], gpus=0.0), "ray") as group:  # what fits still runs
        assert [r for r, _, _ in group.whoami()] == [0, 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts this machine's GPUs: none on the CPU tier")
def test_one_machine_refuses_more_gpu_workers_than_gpus():
    with pytest.raises(
        ValueError, match="wants 2 GPU workers on this machine and it sees 0 GPU\\(s\\); the pool follows k"
    ):
        check_placement([pool([2])], "process", "k")
    check_placement([pool([2], gpus=0.0)], "local", "k")  # CPU workers need no GPU
