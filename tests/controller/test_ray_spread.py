"""A pool of several nodes is several nodes: its node-shares go on distinct Ray nodes (one
placement group, one bundle a node, ``STRICT_SPREAD``), and a cluster with fewer nodes than the
pool spans is refused at once, naming the pool. Before, each share was a placement group of its
own and Ray could pack two of them onto one node with room for both. The two-raylet run is
tests/dataplane/test_two_nodes_grpo.py (slow)."""

import time

import pytest

from tandem.controller import ResourcePool, create_worker_group
from tandem.controller.ray_capacity import check_cluster_holds
from tandem.controller.ray_group import placement_bundles
from tests.controller.workers import EchoWorker


def test_one_bundle_a_node_spread_over_distinct_nodes():
    two_nodes = ResourcePool((2, 3), cpus_per_process=0.5, gpus_per_process=1.0, name="actor")
    assert placement_bundles(two_nodes) == (
        [{"CPU": 1.0, "GPU": 2.0}, {"CPU": 1.5, "GPU": 3.0}],
        "STRICT_SPREAD",
    )
    assert placement_bundles(ResourcePool((4,))) == ([{"CPU": 4.0}], "STRICT_PACK")


def test_a_pool_of_two_nodes_is_refused_on_one_node_with_room_for_both():
    with pytest.raises(ValueError, match=r"pool 'actor' spans 2 nodes \(processes per node \(1, 1\)\)"):
        check_cluster_holds([ResourcePool((1, 1), name="actor")], [{"CPU": 8.0}])


def test_the_shares_of_one_pool_never_share_a_node():
    nodes = [{"CPU": 4.0}, {"CPU": 0.0}]  # two nodes alive, one with room for both shares
    with pytest.raises(ValueError, match="the shares of one pool onto distinct nodes"):
        check_cluster_holds([ResourcePool((1, 1), name="actor")], nodes)
    check_cluster_holds([ResourcePool((1,), name="actor"), ResourcePool((1,), name="rollout")], nodes)
    check_cluster_holds([ResourcePool((2, 2), name="actor")], [{"CPU": 2.0}, {"CPU": 2.0}])


def test_ray_refuses_a_two_node_pool_on_a_one_node_cluster_at_once(ray_cluster):
    """The session's cluster is one node of 8 CPUs: before, both shares went onto it."""
    if len([n for n in ray_cluster.nodes() if n["Alive"]]) != 1:
        pytest.skip("the session's Ray cluster has several nodes")
    start = time.monotonic()
    with pytest.raises(ValueError, match="pool 'default' spans 2 nodes"):
        create_worker_group(EchoWorker, ResourcePool((1, 1), cpus_per_process=1), "ray")
    assert time.monotonic() - start < 20.0
