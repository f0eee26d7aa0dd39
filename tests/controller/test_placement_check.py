"""Placements that could never be held are refused at once, naming the pools and the keys, on a
real Ray cluster and on this machine; placements that fit are not refused."""

import itertools
import random
import time

import pytest
import torch

from tandem.controller import ResourcePool, check_placement, create_worker_group, factory, ray_capacity
from tandem.controller.ray_capacity import alive_node_resources, check_cluster_holds
from tests.controller.workers import EchoWorker

EIGHT_GPUS = {"CPU": 32.0, "GPU": 8.0}


def pool(per_node, gpus=1.0, cpus=1.0, name="actor"):
    return ResourcePool(tuple(per_node), cpus_per_process=cpus, gpus_per_process=gpus, name=name)


def node_shares(pools):
    return [
        {"CPU": p.cpus_per_process * n, "GPU": p.gpus_per_process * n}
        for p in pools
        for n in p.processes_per_node
    ]


def share_owners(pools):
    return [i for i, p in enumerate(pools) for _ in p.processes_per_node]


def assignments_exist(pools, nodes):
    """The reference: try every assignment of every pool's node-shares to nodes (a pool's shares
    on distinct nodes)."""
    shares, owners = node_shares(pools), share_owners(pools)
    for targets in itertools.product(range(len(nodes)), repeat=len(shares)):
        if len(set(zip(owners, targets, strict=True))) < len(shares):
            continue  # two shares of one pool on one node
        room = [dict(node) for node in nodes]
        for share, target in zip(shares, targets, strict=True):
            for kind, value in share.items():
                room[target][kind] = room[target].get(kind, 0.0) - value
        if all(value >= -1e-9 for node in room for value in node.values()):
            return True
    return False


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
    assert assignments_exist(pools, nodes)
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
    (
        [pool([5, 5]), pool([4], name="critic")],
        [EIGHT_GPUS, EIGHT_GPUS],
        "cannot be placed together: each node-share of a pool goes whole onto one node",
    ),
    (
        [pool([5, 5]), pool([5], name="rollout")],
        [EIGHT_GPUS, EIGHT_GPUS],
        "[actor 5 process(es) (5 CPUs, 5 GPUs), actor 5 process(es) (5 CPUs, 5 GPUs), rollout 5",
    ),
]


@pytest.mark.parametrize("pools,nodes,message", REFUSED)
def test_placements_that_cannot_fit_are_refused_naming_the_pools(pools, nodes, message):
    assert not assignments_exist(pools, nodes)
    with pytest.raises(ValueError) as error:
        check_cluster_holds(pools, nodes)
    assert message in str(error.value)


def test_the_packing_search_agrees_with_trying_every_assignment():
    generator = random.Random(0)
    verdicts = set()
    for _ in range(400):
        nodes = [
            {"CPU": float(generator.choice([4, 8, 16])), "GPU": float(generator.randint(0, 8))}
            for _ in range(generator.randint(1, 3))
        ]
        pools = [
            pool(
                [generator.randint(1, 4) for _ in range(generator.randint(1, 2))],
                gpus=generator.choice([0.0, 0.5, 1.0, 2.0]),
                cpus=generator.choice([0.5, 1.0, 2.0]),
                name=f"pool{i}",
            )
            for i in range(generator.randint(1, 3))
        ]
        expected = assignments_exist(pools, nodes)
        verdicts.add(expected)
        assert ray_capacity.shares_pack(node_shares(pools), nodes, share_owners(pools)) == expected, (
            pools,
            nodes,
        )
        try:
            check_cluster_holds(pools, nodes)
            held = True
        except ValueError:
            held = False
        assert held == expected, (pools, nodes)
    assert verdicts == {True, False}  # the draws cover both answers


def test_a_search_past_its_limit_leaves_the_verdict_to_ray(monkeypatch):
    shares = [{"CPU": 1.0, "GPU": 3.0}] * 6  # six 3-GPU shares; only five nodes can take one
    nodes = [{"CPU": 8.0, "GPU": 4.0}] * 5 + [{"CPU": 8.0, "GPU": 2.0}]
    assert not ray_capacity.shares_pack(shares, nodes)
    monkeypatch.setattr(ray_capacity, "PACKING_SEARCH_LIMIT", 3)
    assert ray_capacity.shares_pack(shares, nodes)


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts this machine's GPUs: none on the CPU tier")
def test_a_cuda_device_is_refused_where_no_worker_would_see_a_gpu():
    with pytest.raises(ValueError, match="engine.device='cuda' asks for a CUDA GPU and this machine sees 0"):
        check_placement([pool([1], gpus=0.0)], "local", "k", device=("engine.device", "cuda"))
    with pytest.raises(ValueError, match="pool 'actor' reserves no GPUs .*\\(the pools follow k\\)"):
        check_placement([pool([1], gpus=0.0)], "ray", "k", device=("engine.device", "cuda"))
    check_placement([pool([1], gpus=0.0)], "local", "k", device=("engine.device", "auto"))  # auto: the CPU


def test_workers_that_would_share_a_gpu_are_refused(monkeypatch):
    """The decision for a machine with one GPU (the GPU tier tests it on real ones): ``auto`` and
    ``cuda`` workers each need a GPU of their own; ``cpu`` workers need none."""
    monkeypatch.setattr(factory, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(factory, "resolve_device", lambda setting: None)
    for setting in ("auto", "cuda"):
        with pytest.raises(
            ValueError,
            match="wants 2 GPU workers on this machine and it sees 1 GPU\\(s\\); the pool follows k "
            "\\(CPU workers: engine.device=cpu and the GPU count at 0\\)",
        ):
            check_placement([pool([2], gpus=0.0)], "process", "k", device=("engine.device", setting))
        check_placement([pool([1], gpus=0.0)], "process", "k", device=("engine.device", setting))
    check_placement([pool([2], gpus=0.0)], "process", "k", device=("engine.device", "cpu"))
