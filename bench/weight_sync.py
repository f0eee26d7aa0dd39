"""Seconds and GB/s to sync a Qwen2.5-0.5B-shaped model (494M parameters, random init) from a
trainer process to one rollout replica in another process, per checkpoint-engine backend, fp32
and bf16, against ``memcpy`` of the same bytes (``copy_`` tensor by tensor, one process) in
the same run.

The replica copies every received tensor into its own preallocated weights, as a rollout
engine's ``update_weights`` does; a sync counts from the sender's first byte until the
replica holds the last tensor. ``naive`` (a rollout engine in the trainer's process) is that
same tensor-by-tensor copy, so the memcpy line stands for it. Goal (issue #19): shared memory
at ≥50% of memcpy bandwidth. Medians of ``--repeats`` syncs after one untimed warm-up sync
(the first sync faults in every page of the slots and the replica's weights; its time is
printed too).

Sender and replica each get ``--threads-per-side`` torch threads (default 1: each side its
share of a 2-core machine, as two processes on separate resources would have). memcpy is
measured with all of this process's threads (the strict baseline) and with one.

    python bench/weight_sync.py [--repeats 3] [--bucket-mb 64] [--backends broadcast,shared_memory,files]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

from tandem.checkpoint_engine import CheckpointEngineConfig, WeightReceiver, WeightSender  # noqa: E402

VOCAB, HIDDEN, LAYERS, INTERMEDIATE, KV = 151_936, 896, 24, 4_864, 128


def qwen25_05b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of Qwen2.5-0.5B (tied embedding and head: one tensor)."""
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.q_proj.bias", (HIDDEN,)),
            (p + "self_attn.k_proj.weight", (KV, HIDDEN)),
            (p + "self_attn.k_proj.bias", (KV,)),
            (p + "self_attn.v_proj.weight", (KV, HIDDEN)),
            (p + "self_attn.v_proj.bias", (KV,)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
            (p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
        ]
    return shapes + [("model.norm.weight", (HIDDEN,))]


def random_weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in qwen25_05b_shapes()}


def replica(config, address, dtype, versions, report, threads) -> None:
    """The receiving process: copy each version's tensors into its own weights; report when done."""
    torch.set_num_threads(threads)
    weights = {name: torch.empty(shape, dtype=dtype) for name, shape in qwen25_05b_shapes()}
    receiver = WeightReceiver(config, address, 1, torch.device("cpu"))
    for version in range(1, versions + 1):
        for name, tensor in receiver.receive(version):
            weights[name].copy_(tensor)
        report.send(time.perf_counter())
    checksum = float(sum(t.float().sum() for t in weights.values()))
    receiver.close()
    report.send(checksum)


def memcpy_seconds(source: dict[str, torch.Tensor], repeats: int, threads: int) -> float:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    target = {name: torch.empty_like(t) for name, t in source.items()}
    times = []
    for _ in range(repeats + 1):  # the first pass faults the target pages in, as a replica's first sync does
        start = time.perf_counter()
        for name, tensor in source.items():
            target[name].copy_(tensor)
        times.append(time.perf_counter() - start)
    torch.set_num_threads(previous)
    return statistics.median(times[1:])


def sync_seconds(
    backend: str, source: dict[str, torch.Tensor], args, directory: str
) -> tuple[float, float, bool]:
    """Median seconds per sync (sender start → replica holds everything), the first sync's
    seconds, and whether the replica's copy is exact."""
    config = CheckpointEngineConfig(
        backend=backend,
        bucket_mb=args.bucket_mb,
        directory=directory if backend == "files" else "",
        timeout_s=600,
    )
    sender = WeightSender(config, receivers=1, device=torch.device("cpu"))
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    dtype = next(iter(source.values())).dtype
    versions = args.repeats + 1  # the first sync is a warm-up (page faults on both sides)
    process = context.Process(
        target=replica, args=(config, sender.address, dtype, versions, theirs, args.threads_per_side)
    )
    process.start()
    sender.connect()
    times = []
    for version in range(1, versions + 1):
        start = time.perf_counter()
        sender.send(source.items(), version)
        times.append(ours.recv() - start)
    checksum = ours.recv()
    process.join(timeout=60)
    sender.close()
    expected = float(sum(t.float().sum() for t in source.values()))
    return statistics.median(times[1:]), times[0], checksum == expected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--threads-per-side", type=int, default=1)
    parser.add_argument("--backends", default="broadcast,shared_memory,files")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    print(describe_machine())
    print(
        f"bucket {args.bucket_mb:g} MB, {args.repeats} timed syncs per line (median), one replica process, "
        f"{args.threads_per_side} torch thread(s) per side"
    )
    all_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads_per_side)
    with tempfile.TemporaryDirectory(prefix="tandem-weight-sync-") as directory:
        for dtype_name in args.dtypes.split(","):
            source = random_weights(getattr(torch, dtype_name))
            gb = sum(t.numel() * t.element_size() for t in source.values()) / 1e9
            base = memcpy_seconds(source, args.repeats, all_threads)
            single = memcpy_seconds(source, args.repeats, 1)
            print(
                f"\n{dtype_name}: {gb:.2f} GB; memcpy {base:.3f} s = {gb / base:.2f} GB/s with {all_threads} threads, "
                f"{single:.3f} s with 1 (naive backend: the same copy)"
            )
            for backend in args.backends.split(","):
                seconds, first, exact = sync_seconds(backend, source, args, directory)
                print(
                    f"  {backend:14s} {seconds:7.3f} s  {gb / seconds:6.2f} GB/s  {base / seconds:6.1%} of memcpy "
                    f"({single / seconds:.1%} of 1-thread memcpy); first sync {first:.2f} s; "
                    f"{'exact' if exact else 'MISMATCH'}"
                )
            del source


if __name__ == "__main__":
    main()
