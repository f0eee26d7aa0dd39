"""Milliseconds to hand a training batch from the controller to its workers: pickled (through
the process pipe, or Ray's object store) against shared-memory files (only a path travels; the
worker's tensors are views of the file), in the same run.

The batch is shaped like a GRPO step's (``--rows`` sequences of ``--width`` tokens: int64 ids,
masks and positions, fp32 log-probs and advantages; 7.3 MB at the defaults), split over
``--workers`` workers as ``DP_COMPUTE`` splits it. Each line is the median of ``--repeats``
calls of a worker method that reads one value of every tensor, so the worker really holds the
data; a call with no batch is the floor.

    python bench/batch_transport.py [--rows 512] [--width 512] [--workers 2] [--repeats 10] [--no-ray]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

from tandem.controller import ResourcePool, Worker, create_worker_group, register  # noqa: E402
from tandem.protocol import Batch  # noqa: E402
from tandem.protocol.shared import batch_nbytes  # noqa: E402


class TouchWorker(Worker):
    @register(dispatch="DP_COMPUTE")
    def touch(self, batch: Batch) -> list[float]:
        return [float(t.reshape(-1)[-1]) for t in batch.tensors.values()]

    @register(dispatch="ONE_TO_ALL")
    def nothing(self) -> None:
        return None


def grpo_like_batch(rows: int, width: int) -> Batch:
    ids = torch.randint(0, 150_000, (rows, width))
    mask = torch.ones(rows, width, dtype=torch.int64)
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": torch.arange(width).expand(rows, width).contiguous(),
            "old_log_probs": torch.randn(rows, width // 2),
            "advantages": torch.randn(rows, width // 2),
        },
        non_tensors={"uid": [f"g{i // 8}" for i in range(rows)]},
    )


def median_ms(call, repeats: int) -> float:
    call()  # warm-up (the first shared call also probes which workers see /dev/shm)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(backend: str, args: argparse.Namespace, batch: Batch) -> None:
    pool = ResourcePool((args.workers,), cpus_per_process=1)
    with create_worker_group(TouchWorker, pool, backend) as group:
        floor = median_ms(group.nothing, args.repeats)
        shared = median_ms(lambda: group.touch(batch), args.repeats)
        sharer, group.sharer = group.sharer, None  # pickled from here on
        pickled = median_ms(lambda: group.touch(batch), args.repeats)
        group.sharer = sharer
    print(
        f"  {backend:8s} pickled {pickled:7.1f} ms   shared memory {shared:6.1f} ms   "
        f"{pickled / shared:5.1f}x   (empty call {floor:.1f} ms)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args()
    print(describe_machine())
    batch = grpo_like_batch(args.rows, args.width)
    print(
        f"batch: {args.rows} x {args.width}, {batch_nbytes(batch) / 1e6:.1f} MB of tensors, "
        f"to {args.workers} workers; median of {args.repeats} calls"
    )
    measure("process", args, batch)
    if not args.no_ray:
        import ray

        ray.init(include_dashboard=False, log_to_driver=False)
        measure("ray", args, batch)
        ray.shutdown()


if __name__ == "__main__":
    main()
