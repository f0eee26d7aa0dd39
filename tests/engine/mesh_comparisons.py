"""How the mesh tests (sequence and tensor parallelism) compare split ranks with one process."""

from __future__ import annotations

import torch

TOLERANCE = 1e-5  # max abs difference allowed against the one-process reference (fp32)


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
