"""A plugin's names resolve in every worker process, as its worker is built: spawned processes
(two ranks) and a real local Ray cluster, each compared with the estimator run here; and every
example plugin's names (examples/plugins/, one per kind) resolve there to the file that defined them."""

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


EXAMPLE_NAMES = {  # example plugin -> the (registry, name) pairs it adds (tests/plugins/workers.py's registries)
    "advantage_estimator": [("advantage_estimators", "grpo_loop")],
    "policy_loss": [("policy_losses", "ppo_clip_only")],
    "kl_estimator": [("kl_estimators", "k3_unclamped")],
    "preference_loss": [("preference_losses", "logistic_margin")],
    "reward_function": [("scorers", "word_overlap")],
    "agent_loop": [("agent_loops", "revise_once")],
    "step_stage": [("advantage_estimators", "grpo_token_cost"), ("step_stages", "token_cost")],
}


def _check_workers_resolve_the_plugin(backend: str) -> None:
    load_plugins([example(name) for name in EXAMPLE_NAMES])
    expected = compute_advantage(
        AdvantageInput(REWARDS, torch.ones_like(REWARDS), group_ids=GROUPS), AdvantageConfig("grpo")
    ).advantages  # the built-in grpo, here: the reference
    group = create_worker_group(
        EstimatorWorker, ResourcePool((2,), cpus_per_process=1), backend, kwargs={"estimator": "grpo_loop"}
    )
    names = [pair for pairs in EXAMPLE_NAMES.values() for pair in pairs]
    try:
        answers = group.advantages(REWARDS, GROUPS)
        defined = group.defined_in(names)
    finally:
        group.shutdown()
    files = [example(name) for name, pairs in EXAMPLE_NAMES.items() for _ in pairs]
    assert defined == [files, files]  # each rank resolves every example's names to its file
    assert len({pid for _, _, pid in answers} | {os.getpid()}) == 3  # two processes, neither this one
    for advantages, source, _ in answers:
        torch.testing.assert_close(advantages, expected)
        assert source == example("advantage_estimator")


def test_spawned_worker_processes_import_the_plugins():
    _check_workers_resolve_the_plugin("process")


@pytest.mark.slow
def test_ray_actors_import_the_plugins(ray_cluster):
    _check_workers_resolve_the_plugin("ray")
