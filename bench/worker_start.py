"""Seconds to start a worker group of ``--world`` processes on this machine: workers forked from
the preloaded fork server (what the ``local`` and ``process`` backends do) against workers spawned
afresh (Python's ``spawn``: each imports torch, tensordict, transformers and tandem itself), in
the same run.

The worker's module imports the RL worker's (``tandem.rl.worker``), as a real run's workers do.
Each line: the first group (the fork server starts and imports its libraries then) and the median
of ``--repeats`` groups after it; a group counts from the call to the moment every constructor
has returned, its shutdown excluded.

    python bench/worker_start.py [--world 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

import tandem.rl.worker  # noqa: E402, F401 (what a run's worker processes import)
from tandem.controller import ResourcePool, Worker, create_worker_group, local, register  # noqa: E402


class IdleWorker(Worker):
    @register(dispatch="ONE_TO_ALL")
    def pid(self) -> int:
        import os

        return os.getpid()


def _start_seconds(world: int) -> float:
    began = time.perf_counter()
    group = create_worker_group(IdleWorker, ResourcePool((world,), cpus_per_process=1), "process")
    seconds = time.perf_counter() - began
    group.shutdown()
    return seconds


def _measure(world: int, repeats: int) -> tuple[float, float]:
    first = _start_seconds(world)
    return first, statistics.median(_start_seconds(world) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(describe_machine())
    forked = _measure(args.world, args.repeats)
    local.worker_context = lambda: multiprocessing.get_context("spawn")  # the baseline: spawned afresh
    spawned = _measure(args.world, args.repeats)
    print(f"{'workers':<28}{'first group':>12}{'later groups':>14}")
    print(f"{'forked from the server':<28}{forked[0]:>11.2f}s{forked[1]:>13.2f}s")
    print(f"{'spawned afresh':<28}{spawned[0]:>11.2f}s{spawned[1]:>13.2f}s")
    print(f"later groups: forked {spawned[1] / forked[1]:.0f}x faster than spawned ({args.world} workers)")


if __name__ == "__main__":
    main()
