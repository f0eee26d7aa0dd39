"""Backends the controller tests run against: in-process, spawned processes (local), and real Ray."""

import pytest

from tandem.controller import ResourcePool, create_worker_group
from tests.controller.workers import EchoWorker

BACKENDS = [("local", 1), ("local", 2), ("ray", 2)]


@pytest.fixture(scope="module", params=BACKENDS, ids=[f"{b}-{n}" for b, n in BACKENDS])
def backend_world(request):
    backend, world = request.param
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    return backend, world


def _echo_group(backend_world):
    backend, world = backend_world
    return create_worker_group(
        EchoWorker, ResourcePool((world,), cpus_per_process=1), backend, kwargs={"scale": 1.0}
    )


@pytest.fixture(scope="module")
def echo_group(backend_world):
    """One group per backend for the tests that leave it healthy (starting processes costs seconds)."""
    group = _echo_group(backend_world)
    yield group
    group.shutdown()


@pytest.fixture
def fresh_echo_group(backend_world):
    """A group of its own, for tests that kill a worker."""
    group = _echo_group(backend_world)
    yield group
    group.shutdown()


@pytest.fixture(scope="module", autouse=True)
def destroy_in_process_group():
    """In-process workers initialise torch.distributed in the test process itself; tear it down after the module."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
