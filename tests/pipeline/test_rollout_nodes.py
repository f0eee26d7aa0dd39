"""``pipeline.rollout_nodes``: the rollout replicas split evenly over several nodes, one bundle of
the rollout pool per node, the bundles on distinct nodes; the refusals name the keys. The run on
two raylets is tests/dataplane/test_two_nodes_replicas.py (slow)."""

import pytest

from tandem.controller.ray_capacity import check_cluster_holds
from tandem.controller.ray_group import placement_bundles
from tandem.pipeline.config import PipelineConfig
from tandem.rl.plan import pipeline_plan
from tests.rl.conftest import small_config

ON_RAY = ("trainer.backend=ray", "pipeline.mode=fully_async")


def test_the_replicas_split_evenly_over_the_nodes_one_bundle_each(rl_files, tmp_path):
    """Four replicas over two nodes: two a node, two bundles spread over distinct nodes; the same
    processes and reservations in all as the four on one node (the reference)."""
    spread = small_config(
        rl_files, tmp_path, *ON_RAY, "pipeline.rollout_replicas=4", "pipeline.rollout_nodes=2"
    )
    one = small_config(rl_files, tmp_path, *ON_RAY, "pipeline.rollout_replicas=4")
    pool = spread.rollout_resource_pool()
    assert (pool.name, pool.processes_per_node) == ("rollout", (2, 2))
    assert one.rollout_resource_pool().processes_per_node == (4,)
    assert pool.world_size == one.rollout_resource_pool().world_size
    assert [pool.node_and_local_rank(rank) for rank in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    bundles, strategy = placement_bundles(pool)
    assert (bundles, strategy) == ([{"CPU": 2.0}, {"CPU": 2.0}], "STRICT_SPREAD")
    assert sum(b["CPU"] for b in bundles) == sum(
        b["CPU"] for b in placement_bundles(one.rollout_resource_pool())[0]
    )
    assert "4 rollout replica(s) over 2 nodes, pipeline.mode=fully_async" in pipeline_plan(spread)
    assert "4 rollout replica(s), pipeline.mode=fully_async" in pipeline_plan(one)
    pools = spread.resource_pools()
    assert [(p.name, p.processes_per_node) for p in pools] == [
        ("actor_rollout_ref", (1,)),
        ("rollout", (2, 2)),
    ]


def test_a_cluster_with_fewer_nodes_is_refused_naming_the_rollout_pool(rl_files, tmp_path):
    config = small_config(
        rl_files, tmp_path, *ON_RAY, "pipeline.rollout_replicas=2", "pipeline.rollout_nodes=2"
    )
    with pytest.raises(ValueError, match=r"pool 'rollout' spans 2 nodes \(processes per node \(1, 1\)\)"):
        check_cluster_holds(config.resource_pools(), [{"CPU": 16.0}])
    with pytest.raises(ValueError, match="the shares of one pool onto distinct nodes"):
        check_cluster_holds(config.resource_pools(), [{"CPU": 16.0}, {"CPU": 0.5}])
    check_cluster_holds(config.resource_pools(), [{"CPU": 2.0}, {"CPU": 1.0}])  # trainer + replica, replica


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"rollout_replicas": 3, "rollout_nodes": 2},
            r"pipeline.rollout_replicas=3 must divide evenly over pipeline.rollout_nodes=2",
        ),
        ({"rollout_replicas": 2, "rollout_nodes": 0}, "pipeline.rollout_nodes"),
        (
            {"rollout_replicas": 2, "rollout_nodes": 2, "mode": "sync"},
            "pipeline.rollout_nodes=2 .*pipeline.mode=sync",
        ),
    ],
)
def test_rollout_nodes_that_cannot_split_the_replicas_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**{"mode": "fully_async", **fields})
    assert PipelineConfig(mode="one_step_off", rollout_replicas=6, rollout_nodes=3).rollout_nodes == 3


def test_replicas_on_several_nodes_need_the_ray_backend(rl_files, tmp_path):
    with pytest.raises(
        ValueError, match=r"pipeline.rollout_nodes=2 .*trainer.backend=ray \(got trainer.backend=local"
    ):
        small_config(
            rl_files,
            tmp_path,
            "pipeline.mode=one_step_off",
            "pipeline.rollout_replicas=2",
            "pipeline.rollout_nodes=2",
        )
