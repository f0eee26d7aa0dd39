"""How the mesh tests (sequence and tensor parallelism) compare split ranks with one process:
their worker groups, and the comparisons."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tandem.controller import ResourcePool, create_worker_group
from tandem.device import cuda_device_count

TOLERANCE = 1e-5  # max abs difference allowed against the one-process reference (fp32)


def mesh_groups(worker: type, parallelism: str) -> tuple[Callable, Callable, Callable]:
    """A test module's three worker-group fixtures (module scope) for ``worker``:
    ``one_process`` (the reference, a world of one in this process), ``two_ranks`` (two gloo
    processes that every test of the module reuses, each building its own engine) and
    ``gpu_groups`` (the same on one GPU and on two NCCL ranks; skipped without two GPUs)."""

    @pytest.fixture(scope="module", name="one_process")
    def one_process():
        with create_worker_group(worker, ResourcePool((1,)), "local") as group:
            yield group

    @pytest.fixture(scope="module", name="two_ranks")
    def two_ranks():
        with create_worker_group(worker, ResourcePool((2,)), "process") as group:
            yield group

    @pytest.fixture(scope="module", name="gpu_groups")
    def gpu_groups():
        if cuda_device_count() < 2:
            pytest.skip(f"two {parallelism} NCCL ranks need two GPUs")
        kwargs = {"device": "cuda"}
        with (
            create_worker_group(worker, ResourcePool((1,)), "local", kwargs=kwargs) as one,
            create_worker_group(worker, ResourcePool((2,)), "process", kwargs=kwargs) as two,
        ):
            yield one, two

    return one_process, two_ranks, gpu_groups


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def assert_within_tolerance(diffs: dict[str, float], tolerance: float = TOLERANCE) -> None:
    """Every difference within ``tolerance``; prints the worst (``pytest -s`` shows it)."""
    worst = max(diffs, key=diffs.get)
    print(f"max abs diff {diffs[worst]:.3g} at {worst}")
    assert diffs[worst] <= tolerance, {k: v for k, v in diffs.items() if v > tolerance}


def assert_same_gradients(split: list[dict], whole: dict, tolerance: float = TOLERANCE) -> None:
    """Each rank's outputs, loss and full gradients equal the one-process ones within ``tolerance``."""
    diffs = {}
    for rank, got in enumerate(split):
        assert got["outputs"].keys() == whole["outputs"].keys()
        assert got["grads"].keys() == whole["grads"].keys()
        for name, values in whole["outputs"].items():
            diffs[f"rank{rank}/{name}"] = max_diff(got["outputs"][name], values)
        diffs[f"rank{rank}/loss"] = abs(got["loss"] - whole["loss"])
        for name, grad in whole["grads"].items():
            diffs[f"rank{rank}/grad/{name}"] = max_diff(got["grads"][name], grad)
    assert_within_tolerance(diffs, tolerance)
