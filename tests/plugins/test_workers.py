"""A plugin's names resolve in every worker process, as its worker is built: spawned processes
(two ranks) and a real local Ray cluster, each compared with the estimator run here."""

import os

import pytest
import torch

from tandem.algos import AdvantageConfig, AdvantageInput, compute_advantage
from tandem.config.plugins import load_plugins
from tandem.controller import ResourcePool, create_worker_group
from tests.plugins.conftest import example
from tests.plugins.workers import EstimatorWorker

REWARDS = torch.tensor([[1.0, 0.0], [0.0, 0.5], [2.0, 0.0], [0.0, 0.0]])
GROUPS = torch.tensor([0, 0, 1, 1])


def _check_workers_resolve_the_plugin(backend: str) -> None:
    load_plugins([example("advantage_estimator")])
    expected = compute_advantage(
        AdvantageInput(REWARDS, torch.ones_like(REWARDS), group_ids=GROUPS), AdvantageConfig("grpo")
    ).advantages  # the built-in grpo, here: the reference
    group = create_worker_group(
        EstimatorWorker, ResourcePool((2,), cpus_per_process=1), backend, kwargs={"estimator": "grpo_loop"}
    )
    try:
        answers = group.advantages(REWARDS, GROUPS)
    finally:
        group.shutdown()
    assert len({pid for _, _, pid in answers} | {os.getpid()}) == 3  # two processes, neither this one
    for advantages, source, _ in answers:
        torch.testing.assert_close(advantages, expected)
        assert source == example("advantage_estimator")


def test_spawned_worker_processes_import_the_plugins():
    _check_workers_resolve_the_plugin("process")


@pytest.mark.slow
def test_ray_actors_import_the_plugins(ray_cluster):
    _check_workers_resolve_the_plugin("ray")
