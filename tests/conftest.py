"""Fixtures shared across test packages: a real local Ray cluster."""

import os
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(
        num_cpus=8,  # over-subscribe the 2-core CI machine: tests hold several small groups at once
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": ROOT}},
    )
    yield ray
    ray.shutdown()
