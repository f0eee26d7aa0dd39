"""Today's path (Batch arguments through the controller) against the data plane's (BatchRefs:
the controller moves references, the ranks fetch their rows) for one step of two stages over a
process group of ``--workers`` ranks, side by side in one run.

The step is a rollout-like stage that produces each row's tokens from per-row seeds (prompt and
response lengths drawn per row, so the rows are jagged), then a log-prob-like stage that reads
``input_ids``, ``attention_mask``, ``position_ids``, ``responses`` and ``response_mask`` and
returns ``old_log_probs``. Today the first stage's padded output comes back to the controller
and is shipped again to the second; with references each stage's output stays in its rank's
store. For each size (rows x length grows ``4x`` in each of the two, ``16x`` in all):

* payload bytes the controller serialised or rebuilt per step (:mod:`tandem.protocol.traffic`);
* the controller's peak RSS during the step (``VmHWM``, reset before each step);
* bytes on the wire per real response token (what the second stage's ranks received: today the
  padded int64 batch, with references the jagged narrow columns they fetched).

Then each rank's fetch throughput over a larger batch (``--fetch-rows`` x ``--fetch-width``): the
bytes of the padded batch it built per second of ``materialise`` (wire bytes fetched beside),
against a single-thread ``memcpy`` of a buffer that size into warm pages, timed in that rank in
the same run, alternating with the fetches (so both see the same load); medians, and the ratio by
CPU time too (on a shared machine the clock also counts the time other jobs held the cores).

    python bench/data_plane.py [--rows 32] [--width 512] [--workers 2] [--repeats 21]
                               [--fetch-rows 256] [--fetch-width 4096] [--no-ray-fetch] [--two-nodes]
    python bench/data_plane.py --big-step [--step-rows 22000] [--step-width 4096] [--today-scale 8]
    python bench/data_plane.py --routing 48,8 [--rows 8 --width 128]

``--routing LAYERS,TOPK`` adds an MoE rollout's recorded experts to the step (``routed_experts
[B, S, LAYERS, TOPK]`` int16, -1 on padding, as routing replay's forward reads them) and prints the
step table only.

``--big-step`` runs only a real SFT step whose batch is >= 2 GB on today's path, with the data
plane on, and prints the controller's peak RSS beside today's (:mod:`data_plane_big_step`).

The fetch measure runs for the shared-memory engine (the process group above), then for the Ray
engine: the same ranks as Ray actors on a local one-node Ray cluster the bench starts, their
blocks in Ray's object store, read by the same-node path (decoded from the object store's views).

``--two-nodes`` measures across nodes instead (:func:`across_two_nodes`): two Ray nodes on this
machine, each with a ``/dev/shm`` of its own (``tests/dataplane/two_nodes_cluster.py``; needs
root), one rank on each, each fetching its own rows and then the other node's; and today's path,
the padded batch sent with the call from the controller to the rank on the other node.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

from tandem.controller import ResourcePool, Worker, create_worker_group, register  # noqa: E402
from tandem.dataplane import BatchRef, get, traffic  # noqa: E402
from tandem.protocol import Batch  # noqa: E402
from tandem.protocol.traffic import batch_traffic  # noqa: E402

READS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
ROUTED_READS = (*READS, "routed_experts")  # --routing: an MoE rollout's recorded experts too
PAD = 0
EXPERTS = 128  # Qwen3-30B-A3B's routed experts per layer


def rollout_rows(
    seeds: list[int], prompt_width: int, response_width: int, routing: tuple[int, int] | None = None
) -> Batch:
    """Left-padded prompts and right-padded responses of random lengths, in today's int64 layout;
    with ``routing = (layers, top_k)`` also ``routed_experts [B, S, layers, top_k]`` int16 (the
    rollout's layout, tandem.protocol.sequences): an expert id per token, layer and choice, -1 on
    padding."""
    rows = len(seeds)
    prompts = torch.full((rows, prompt_width), PAD, dtype=torch.int64)
    responses = torch.full((rows, response_width), PAD, dtype=torch.int64)
    for i, seed in enumerate(seeds):
        gen = torch.Generator().manual_seed(seed)
        p = int(torch.randint(prompt_width // 4, prompt_width + 1, (1,), generator=gen))
        r = int(torch.randint(1, response_width + 1, (1,), generator=gen))
        prompts[i, prompt_width - p :] = torch.randint(1, 150_000, (p,), generator=gen)
        responses[i, :r] = torch.randint(1, 150_000, (r,), generator=gen)
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = (input_ids != PAD).long()
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    fields = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": attention_mask[:, prompt_width:].clone(),
    }
    if routing is not None:
        gen = torch.Generator().manual_seed(seeds[0] if seeds else 0)
        experts = torch.randint(0, EXPERTS, (rows, input_ids.shape[1], *routing), generator=gen, dtype=torch.int16)
        fields["routed_experts"] = experts.masked_fill(~attention_mask.bool()[:, :, None, None], -1)
    return Batch(fields)


class BenchWorker(Worker):
    def _generate(
        self, prompts: Batch, prompt_width: int, response_width: int, routing: tuple[int, int] | None = None
    ) -> Batch:
        return rollout_rows([int(s) for s in prompts["seed"]], prompt_width, response_width, routing)

    def _forward(self, batch: Batch) -> Batch:
        width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
        ids = batch["input_ids"][:, width:]
        return Batch({"old_log_probs": -(ids % 97).float() / 97 * batch["response_mask"]})

    @register(dispatch="DP_COMPUTE")
    def generate(self, prompts: Batch, *, prompt_width: int, response_width: int, routing=None) -> Batch:
        return self._generate(prompts, prompt_width, response_width, routing)

    @register(dispatch="DP_COMPUTE", reads=("seed",), outputs="ref")
    def generate_kept(self, prompts: Batch, *, prompt_width: int, response_width: int, routing=None) -> Batch:
        return self._generate(prompts, prompt_width, response_width, routing)

    @register(dispatch="DP_COMPUTE")
    def forward(self, batch: Batch) -> Batch:
        return self._forward(batch)

    @register(dispatch="DP_COMPUTE", reads=READS, outputs="ref")
    def forward_kept(self, batch: Batch) -> Batch:
        return self._forward(batch)

    @register(dispatch="DP_COMPUTE", reads=ROUTED_READS, outputs="ref")
    def forward_kept_routed(self, batch: Batch) -> Batch:
        """:meth:`forward_kept` reading the recorded experts too (routing replay's forward)."""
        return self._forward(batch)

    @register(dispatch="ONE_TO_ALL")
    def receive(self, wrapped: tuple | None) -> int:
        """The bytes of the padded batch this rank holds once the call has run: a ``Batch`` given
        (today's path: it came with the call), or a ``BatchRef`` fetched here; ``None``: nothing."""
        if wrapped is None:
            return 0
        (item,) = wrapped
        built = item.materialise(get, READS) if isinstance(item, BatchRef) else item
        return sum(t.numel() * t.element_size() for t in built.tensors.values())

    @register(dispatch="ALL_TO_ALL")
    def time_fetch(self, wrapped: tuple, repeats: int) -> dict[str, float]:
        """Fetch this rank's rows, and copy a buffer of the padded batch's size, alternately
        ``repeats`` times each; the medians, by the clock and by this thread's CPU time."""
        (ref,) = wrapped  # wrapped, so that the generic path does not fetch it before we time it
        torch.set_num_threads(1)  # the reference is a single-thread memcpy (the fetch uses numpy)

        built = ref.materialise(get, READS)  # warm-up; and the padded batch's size
        built_bytes = sum(t.numel() * t.element_size() for t in built.tensors.values())
        del built
        source = torch.ones(built_bytes, dtype=torch.uint8)
        target = source.clone()  # touched once, so the timed copies do not fault pages in
        fetch, copy = [], []
        before, faults = traffic(), _minor_faults()
        for _ in range(repeats):
            fetch.append(_timed(lambda: ref.materialise(get, READS)))
            copy.append(_timed(lambda: target.copy_(source)))
        fetch_faults = (_minor_faults() - faults) / repeats  # the copies into warm pages fault none
        fetched = (traffic() - before).fetched_bytes / repeats
        (fetch_wall, fetch_cpu), (copy_wall, copy_cpu) = _medians(fetch), _medians(copy)
        return {
            "fetched": fetched,
            "built": built_bytes,
            "fetch_ms": fetch_wall * 1e3,
            "fetch_cpu_ms": fetch_cpu * 1e3,
            "built_gbps": built_bytes / fetch_wall / 1e9,
            "memcpy_gbps": built_bytes / copy_wall / 1e9,
            "cpu_ratio": copy_cpu / fetch_cpu,
            "faults": fetch_faults,
        }


def _timed(call) -> tuple[float, float]:
    """(wall, this thread's CPU) seconds of ``call()``: the CPU time leaves out the time a loaded
    machine keeps the thread waiting, not the page faults it takes."""
    wall, cpu = time.perf_counter(), time.thread_time()
    call()
    return time.perf_counter() - wall, time.thread_time() - cpu


def _medians(timings: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(t[0] for t in timings), statistics.median(t[1] for t in timings)


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def step(group, prompts, widths: dict, use_refs: bool) -> tuple[float, int, float, int]:
    """One step; returns (seconds, controller payload bytes, peak RSS MB, second stage's input bytes)."""
    reset_peak_rss()
    before = batch_traffic()
    start = time.perf_counter()
    if use_refs:
        before_ranks = group.data_traffic()
        start = time.perf_counter()
        generated = group.generate_kept(BatchRef(prompts, (), {}), **widths)
        forward = group.forward_kept_routed if widths.get("routing") else group.forward_kept
        outputs = forward(generated)
        seconds = time.perf_counter() - start
        after_ranks = group.data_traffic()
        wire = sum(
            (a - b).fetched_bytes + (a - b).fetched_index_bytes
            for a, b in zip(after_ranks, before_ranks, strict=True)
        )
        for ref in (generated, outputs):
            group.release_refs(ref)
    else:
        generated = group.generate(prompts, **widths)
        outputs = group.forward(generated)
        seconds = time.perf_counter() - start
        reads = ROUTED_READS if widths.get("routing") else READS
        wire = sum(t.numel() * t.element_size() for t in generated.select(list(reads)).tensors.values())
        del generated, outputs
    return seconds, (batch_traffic() - before).total, peak_rss_mb(), wire


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=32, help="rows at the smallest size")
    parser.add_argument("--width", type=int, default=512, help="prompt + response width at the smallest size")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=21, help="fetches (and copies) timed per rank")
    parser.add_argument("--fetch-rows", type=int, default=256, help="rows of the fetch-throughput batch")
    parser.add_argument("--fetch-width", type=int, default=4096, help="its prompt + response width")
    parser.add_argument("--routing", type=lambda text: tuple(int(v) for v in text.split(",")), default=None,
                        metavar="LAYERS,TOPK", help="the stages also write and read an MoE rollout's recorded experts "
                        "(routed_experts [B, S, LAYERS, TOPK] int16; Qwen3-30B-A3B: 48,8); the step table only")  # fmt: skip
    parser.add_argument("--no-ray-fetch", dest="ray_fetch", action="store_false",
                        help="skip the Ray engine's fetch measure (it starts a local Ray cluster)")  # fmt: skip
    parser.add_argument("--two-nodes", action="store_true",
                        help="only the fetches across two Ray nodes with private /dev/shm (root)")  # fmt: skip
    parser.add_argument("--big-step", action="store_true",
                        help="only an SFT step of a >= 2 GB batch, today vs the data plane (data_plane_big_step.py)")  # fmt: skip
    parser.add_argument("--step-rows", type=int, default=22000, help="--big-step: the step's rows")
    parser.add_argument("--step-width", type=int, default=4096, help="--big-step: its longest row")
    parser.add_argument(
        "--today-scale", type=int, default=8, help="--big-step: today's path at 1/this of the rows"
    )
    args = parser.parse_args()
    # One thread per process (the ranks inherit it): on a machine of few cores shared by the
    # controller and its ranks, OpenMP teams of several threads spin against each other and
    # make every memory-bound op here many times slower, on both paths.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    print(describe_machine())
    if args.big_step:
        from data_plane_big_step import big_step  # noqa: PLC0415 - the trainer, only for this mode

        big_step(args)
        return
    if args.two_nodes:
        across_two_nodes(args)
        return
    group = create_worker_group(BenchWorker, ResourcePool((args.workers,), cpus_per_process=1), "process")
    try:
        print(
            f"{'rows x width':>14} | {'controller payload B/step':>27} | {'controller peak RSS MB':>24} "
            f"| {'wire B / real resp token':>26} | {'step s':>13}"
        )
        print(f"{'':>14} | {'today':>13} {'refs':>13} | {'today':>11} {'refs':>12} | {'today':>12} {'refs':>13} "
              f"| {'today':>6} {'refs':>6}")  # fmt: skip
        sizes = [(args.rows * scale, args.width * scale) for scale in (1, 2, 4)]
        results = {}
        for use_refs in (True, False):  # references first: today's freed batches would raise the RSS floor
            for rows, width in sizes:
                widths = {"prompt_width": width // 4, "response_width": width - width // 4, "routing": args.routing}
                prompts = Batch(non_tensors={"seed": list(range(rows))})
                step(group, prompts, widths, use_refs)  # warm-up (probes, first files)
                results[use_refs, rows] = step(group, prompts, widths, use_refs)
        for rows, width in sizes:
            widths = {"prompt_width": width // 4, "response_width": width - width // 4}
            real = int(rollout_rows(list(range(rows)), **widths)["response_mask"].sum())
            today, refs = results[False, rows], results[True, rows]
            print(
                f"{f'{rows} x {width}':>14} | {today[1]:>13,} {refs[1]:>13,} | {today[2]:>11.0f} {refs[2]:>12.0f} "
                f"| {today[3] / real:>12.1f} {refs[3] / real:>13.1f} | {today[0]:>6.2f} {refs[0]:>6.2f}"
            )
        if args.routing is None:
            fetch_throughput(group, args, "shm")
    finally:
        group.shutdown()
    if args.ray_fetch and args.routing is None:
        fetch_on_ray(args)


def fetch_on_ray(args) -> None:
    """The same fetch measure with the Ray engine: ``--workers`` Ray actors on a local one-node
    Ray cluster (started here), each rank's blocks in Ray's object store."""
    try:
        import ray
    except ImportError:
        print("Ray engine: skipped (Ray is not installed)")
        return
    from tandem.dataplane import DataPlaneConfig

    start = time.perf_counter()
    ray.init(num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                                       "OMP_NUM_THREADS": "1"}})  # fmt: skip
    group = create_worker_group(BenchWorker, ResourcePool((args.workers,), cpus_per_process=1), "ray")
    try:
        group.use_data_store(DataPlaneConfig(engine="ray"))
        print(
            f"Ray engine: local cluster and {args.workers} actors up in {time.perf_counter() - start:.1f} s"
        )
        fetch_throughput(group, args, "ray")
    finally:
        group.shutdown()
        ray.shutdown()


def across_two_nodes(args) -> None:
    """``--two-nodes``: one rank on each of two Ray nodes with private ``/dev/shm``; the
    ``--fetch-rows x --fetch-width`` batch generated half on each node. Each rank fetches its own
    half (same node), then the other node's (across nodes), against a single-thread memcpy in that
    rank; then today's path and the references end to end, timed by the controller on node A: a
    call that hands the rank on node B the half generated on node A, as the padded ``Batch`` sent
    with the call (Ray's object transfer, from the controller) or as a ``BatchRef`` it fetches
    (from node A's rank), less an empty call's time. Printed side by side, with the wire bytes per
    real response token of each."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tandem.dataplane import DataPlaneConfig
    from tests.dataplane.two_nodes_cluster import missing, two_nodes

    if missing():
        print(f"two nodes: skipped ({missing()})")
        return
    start = time.perf_counter()
    with two_nodes(object_store_bytes=400_000_000, shm_size="1g", env_vars={"OMP_NUM_THREADS": "1"}):
        group = create_worker_group(BenchWorker, ResourcePool((1, 1), cpus_per_process=1), "ray")
        try:
            group.use_data_store(DataPlaneConfig(engine="ray"))
            print(f"two nodes and a rank on each up in {time.perf_counter() - start:.1f} s")
            _two_node_fetches(group, args)
        finally:
            group.shutdown()


def _two_node_fetches(group, args) -> None:
    rows, width = args.fetch_rows, args.fetch_width
    widths = {"prompt_width": width // 4, "response_width": width - width // 4}
    generated = group.generate_kept(
        BatchRef(Batch(non_tensors={"seed": list(range(rows))}), (), {}), **widths
    )
    halves = generated.pad_to_divisor(2)[0].chunk(2)  # half h lies in a block on node h
    same = group.time_fetch([(h,) for h in halves], repeats=[args.repeats] * 2)
    cross = group.time_fetch([(h,) for h in reversed(halves)], repeats=[args.repeats] * 2)
    real = [int(rollout_rows(list(part), **widths)["response_mask"].sum()) for part in (range(rows)[: rows // 2], range(rows)[rows // 2 :])]  # fmt: skip
    print(f"ray engine across two nodes, fetch throughput per rank ({rows} x {width} split 2 ways; "
          f"medians of {args.repeats}, fetches and copies alternating):")  # fmt: skip
    for rank in range(2):
        for where, t, half in (("own node  ", same[rank], rank), ("other node", cross[rank], 1 - rank)):
            print(
                f"  rank {rank}, rows on its {where}: built {t['built'] / 1e6:.1f} MB in {t['fetch_ms']:.1f} ms "
                f"(CPU {t['fetch_cpu_ms']:.1f} ms) = {t['built_gbps']:.2f} GB/s; memcpy {t['memcpy_gbps']:.2f} GB/s; "
                f"built / memcpy = {t['built_gbps'] / t['memcpy_gbps']:.0%} (by CPU time {t['cpu_ratio']:.0%}); "
                f"wire {t['fetched'] / real[half]:.1f} B per real response token"
            )
    today_batch = generated.materialise(get, READS).chunk(2)[0]  # today: the controller holds the batch
    today_wire = sum(t.numel() * t.element_size() for t in today_batch.tensors.values()) / real[0]
    empty = _call_seconds(group, 1, None, args.repeats)
    today = _call_seconds(group, 1, (today_batch,), args.repeats) - empty
    refs = _call_seconds(group, 1, (halves[0],), args.repeats) - empty
    built, memcpy = cross[1]["built"], cross[1]["memcpy_gbps"]
    print(f"  node A's half to rank 1 on node B, end to end from the controller (less an empty call's "
          f"{empty * 1e3:.1f} ms), {built / 1e6:.1f} MB padded:")  # fmt: skip
    for name, seconds, wire in (("today (Batch with the call)", today, today_wire),
                                ("refs (BatchRef, rank fetches)", refs, cross[1]["fetched"] / real[0])):  # fmt: skip
        gbps = built / max(seconds, 1e-9) / 1e9
        print(f"    {name:<30} {seconds * 1e3:7.1f} ms = {gbps:.2f} GB/s = {gbps / memcpy:.0%} of rank 1's memcpy; "
              f"wire {wire:.1f} B per real response token")  # fmt: skip
    print(f"    refs / today: {today / max(refs, 1e-9):.1f}x")
    group.release_refs(generated)


def _call_seconds(group, rank: int, argument, repeats: int) -> float:
    """The median seconds of a ``receive(argument)`` call to ``rank`` alone, seen from here."""
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        group.backend.result(rank, group.backend.submit(rank, "receive", (argument,), {}), None)
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def fetch_throughput(group, args, engine: str) -> None:
    """Each rank's fetch of its own rows of a ``--fetch-rows x --fetch-width`` batch its rank put
    (same node), against a single-thread memcpy of the padded batch it builds; printed."""
    rows, width = args.fetch_rows, args.fetch_width
    prompts = Batch(non_tensors={"seed": list(range(rows))})
    widths = {"prompt_width": width // 4, "response_width": width - width // 4}
    generated = group.generate_kept(BatchRef(prompts, (), {}), **widths)
    padded, _ = generated.pad_to_divisor(args.workers)
    timings = group.time_fetch(
        [(c,) for c in padded.chunk(args.workers)], repeats=[args.repeats] * args.workers
    )
    group.release_refs(generated)
    print(f"{engine} engine, fetch throughput per rank ({rows} x {width} split {args.workers} ways; medians of "
          f"{args.repeats}, fetches and copies alternating):")  # fmt: skip
    for rank, t in enumerate(timings):
        print(
            f"  rank {rank}: fetched {t['fetched'] / 1e6:.1f} MB, built a {t['built'] / 1e6:.1f} MB padded batch "
            f"in {t['fetch_ms']:.1f} ms (CPU {t['fetch_cpu_ms']:.1f} ms) = {t['built_gbps']:.2f} GB/s; single-thread memcpy of {t['built'] / 1e6:.1f} "
            f"MB {t['memcpy_gbps']:.2f} GB/s; built / memcpy = {t['built_gbps'] / t['memcpy_gbps']:.0%} "
            f"(by CPU time {t['cpu_ratio']:.0%}); {t['faults']:.0f} page faults per fetch"
        )


if __name__ == "__main__":
    main()
