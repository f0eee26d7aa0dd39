"""Timing tandem against another trainer fairly: each side in a fresh process of its own, in
rounds that alternate which side goes first (the machine's speed drifts), medians compared.

A benchmark script calls :func:`compare` from its ``main`` and, when started with
``--side NAME --root DIR --steps N --warmup N``, times that side and prints one JSON line
``{"step": [seconds, ...], <phase>: [...]}`` (or ``null`` when the side is not installed).
``--trl-python`` runs the baseline's child with another environment's interpreter (TRL kept out
of tandem's venv); the repository root is put on its ``PYTHONPATH`` so the script imports.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# TRL's trainer arguments for a CPU timing run: fp32, no checkpointing, no logging or saving.
TRL_CPU_ARGS = {
    "use_cpu": True,
    "bf16": False,
    "gradient_checkpointing": False,
    "logging_steps": 1000,
    "save_strategy": "no",
    "report_to": "none",
    "disable_tqdm": True,
}


def side_parser(doc: str) -> argparse.ArgumentParser:
    """The options every side-by-side benchmark takes (``--steps``, ``--warmup``, ``--rounds``)
    and the hidden ones of a child run (``--side``, ``--root``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--trl-python", default=sys.executable, help="the interpreter of the baseline's environment"
    )
    parser.add_argument("--side", choices=["tandem", "baseline"], help=argparse.SUPPRESS)  # a child run
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    return parser


def step_timer():
    """A transformers ``TrainerCallback`` recording each optimizer step's seconds in ``.times``."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.started)

    return StepTimer()


def run_child(
    side: str,
    tandem: Callable[[], dict[str, list[float]]],
    baseline: Callable[[], list[float] | None],
) -> None:
    """A child run: time ``side`` on 2 threads and print its JSON line (``null`` when the
    baseline is not installed, which ``baseline`` says by returning None)."""
    torch.set_num_threads(2)
    if side == "tandem":
        times = tandem()
    else:
        steps = baseline()
        times = None if steps is None else {"step": steps}
    print(json.dumps(times))


def run_side(
    script: str, side: str, root: Path, steps: int, warmup: int, python: str = sys.executable
) -> dict[str, list[float]] | None:
    """Time ``side`` in a fresh process of ``python`` running ``script``; ``None`` when not installed."""
    command = [
        python,
        script,
        "--side",
        side,
        "--root",
        str(root),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
    ]
    repository = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (repository, os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
    if done.returncode != 0:
        raise RuntimeError(f"the {side} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def baseline_versions(python: str) -> str:
    """The versions of trl, transformers and torch in ``python``'s environment, as one line."""
    code = (
        "import importlib.metadata as m\n"
        "def v(name):\n"
        "    try:\n"
        "        return m.version(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        return 'not installed'\n"
        "print(', '.join(f'{n} {v(n)}' for n in ('trl', 'transformers', 'torch')))"
    )
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return f"baseline environment ({python}): {done.stdout.strip()}"


def round_line(round_: int, label: str, measured: dict[str, list[float]]) -> str:
    """One round's medians: the step, then each phase the run reported."""
    phases = "".join(f", {k} {statistics.median(v):.3f}" for k, v in measured.items() if k != "step")
    return f"round {round_ + 1} {label}: median {statistics.median(measured['step']):.3f} s/step{phases}"


def compare(
    script: str,
    root: Path,
    rounds: int,
    steps: int,
    warmup: int,
    baseline: str,
    what: str,
    baseline_python: str = sys.executable,
) -> None:
    """Alternate tandem and ``baseline`` (its label, e.g. ``TRL DPOTrainer``; its child runs on
    ``baseline_python``) over ``rounds`` and print the medians and the ratio of seconds per
    ``what`` (e.g. ``DPO step``)."""
    times: dict[str, list[float]] = {"tandem": [], "baseline": []}
    installed = True
    for round_ in range(rounds):
        for side in ("tandem", "baseline") if round_ % 2 == 0 else ("baseline", "tandem"):
            if side == "baseline" and not installed:
                continue
            python = baseline_python if side == "baseline" else sys.executable
            measured = run_side(script, side, root, steps, warmup, python)
            if measured is None:
                installed = False
                continue
            times[side] += measured["step"]
            print(round_line(round_, "tandem" if side == "tandem" else baseline, measured))
    ours = statistics.median(times["tandem"])
    print(
        f"tandem: median {ours:.3f} s/step over {len(times['tandem'])} steps ({[round(t, 3) for t in times['tandem']]})"
    )
    if not installed:
        print(f"{baseline} is not installed: no baseline")
        return
    theirs = statistics.median(times["baseline"])
    print(
        f"{baseline}: median {theirs:.3f} s/step over {len(times['baseline'])} steps "
        f"({[round(t, 3) for t in times['baseline']]})"
    )
    print(f"speed-up: tandem is {theirs / ours:.2f}x faster per {what}")
