"""How the mesh tests (sequence, tensor and expert parallelism) compare split ranks with one
process: their worker groups, their engine settings, a step, a resume, and the comparisons."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.controller import ResourcePool, create_worker_group
from tandem.device import cuda_device_count
from tandem.engine import EngineConfig

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


def mesh_config(model_dir: str, **overrides) -> EngineConfig:
    """A small token budget and no pad multiple: several micro-batches per step, rows of odd
    lengths, uneven over the ranks."""
    base = EngineConfig(
        model_path=model_dir, lr=1e-2, eps=1e-3, max_tokens_per_micro_batch=48, pad_tokens_to_multiple=1
    )
    return dataclasses.replace(base, **overrides)


def train_step(group, batch) -> tuple:
    """One optimizer step: the pre-step outputs, loss and grad norm, and the updated weights."""
    return group.train_step(batch), group.parameters()[0]


def resumed_steps(
    groups: dict, configs: dict, saved: int, resumed: int, first, second, directory: Path
) -> dict:
    """Train ``first`` on ``groups[saved]`` and save; then, for the sizes ``saved`` and ``resumed``,
    build that group afresh, load the checkpoint and take one :func:`train_step` on ``second``."""
    saver = groups[saved]
    saver.build(configs[saved])
    saver.train_step(first)
    saver.save(str(directory / "checkpoint"))
    steps = {}
    for size in (saved, resumed):
        groups[size].build(configs[size])
        groups[size].load(str(directory / "checkpoint"))
        steps[size] = train_step(groups[size], second)
    return steps


def assert_same_step(
    split: tuple[dict, dict],
    whole: tuple[dict, dict],
    dp_size: int = 1,
    outputs: tuple[str, ...] = ("log_probs", "entropy"),
) -> None:
    """Two :func:`train_step` results agree: ``outputs``, the grad norm, every updated weight,
    and the loss (each of the ``dp_size`` data-parallel ranks reports its share on its rows:
    the shares add up to the whole loss)."""
    (got, got_params), (expected, expected_params) = split, whole
    diffs = {name: max_diff(got[name], expected[name]) for name in (*outputs, "grad_norm")}
    rows = len(got["loss"]) // dp_size
    loss = sum(float(got["loss"][rank * rows]) for rank in range(dp_size))
    diffs["loss"] = abs(loss - float(expected["loss"][0]))
    assert got_params.keys() == expected_params.keys()
    diffs |= {name: max_diff(got_params[name], tensor) for name, tensor in expected_params.items()}
    assert_within_tolerance(diffs)


def export_and_sync_diffs(one_process, two_ranks, split_config, batch, directory: Path) -> tuple[dict, dict]:
    """After one step on ``batch`` each (the one-process engine as built, ``two_ranks`` built
    with ``split_config``), the differences of the split engine's HF export and weight-sync
    buckets (64 KiB, never more than a bucket or the largest tensor gathered at once) from the
    one-process weights; and the export's tensors."""
    one_process.train_step(batch)
    expected = one_process.parameters()[0]
    two_ranks.build(split_config)
    two_ranks.train_step(batch)
    two_ranks.export(str(directory / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(directory / "hf").state_dict()
    limit = 64 * 1024
    largest_tensor = max(t.numel() * t.element_size() for t in expected.values())
    diffs = {}
    for rank, got in enumerate(two_ranks.weight_buckets(limit)):
        assert got["tensors"].keys() == expected.keys()
        assert got["largest_bucket"] <= max(limit, largest_tensor)  # never the whole model at once
        diffs |= {f"rank{rank}/sync/{n}": max_diff(got["tensors"][n], t) for n, t in expected.items()}
    diffs |= {f"export/{name}": max_diff(exported[name], tensor) for name, tensor in expected.items()}
    return diffs, exported
