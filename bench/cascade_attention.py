"""Plain decode attention vs the shared-prefix cascade (tandem/rollout/shared_prefix.py).

The native engine reads each shared prompt once per decode step (the cascade) when
:func:`~tandem.rollout.shared_prefix.worth_sharing` says it pays. This measures both paths on
the attention heads of SmolLM2-135M (30 layers, 9 query heads over 3 key/value heads of 64)
for a batch of ``prompts x n`` sequences, prompt ``P`` tokens, ``T`` new tokens:

* ``--level attention`` (default): one decode step's attention over all layers (the cache
  writes, the step's biases and the products), averaged over the decode's positions
  ``P .. P+T-1``, for each shape of the grid, fp32, 2 threads. The rest of a step (the
  linear layers, the head) is the same on both paths.
* ``--level engine``: the native engine on SmolLM2 itself (``share_prefix_reads`` on and
  off, alternating), generated tokens/s of ``prompts x n`` requests with ``T`` new tokens
  each (EOS ignored), random prompt ids of ``P`` tokens; also what the engine chose.

    python bench/cascade_attention.py [--level attention|engine] [--repeats 5]
        [--shapes 8x4:52:32,...]   # prompts x n : prompt tokens : new tokens
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402
from real_model import smollm2_dir  # noqa: E402

from tandem.rollout.kv_cache import SlotKVCache, StepPlan, decode_step_attention  # noqa: E402
from tandem.rollout.shared_prefix import SharedPrefixes, worth_sharing  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64  # SmolLM2-135M's attention
# prompts x n : prompt tokens : new tokens; the first is the GRPO benchmark's shape
DEFAULT_SHAPES = (
    "8x4:52:32,8x4:52:256,2x16:52:32,2x16:52:256,8x4:500:32,8x4:500:256,2x16:500:32,2x16:500:256,"
    "16x4:52:32,32x4:52:32,8x4:150:32,8x4:250:32"
)


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """``"8x4:52:32,..."`` -> ``[(prompts, n, prompt_tokens, new_tokens), ...]``."""
    shapes = []
    for item in text.split(","):
        batch, prompt, new = item.split(":")
        prompts, n = batch.split("x")
        shapes.append((int(prompts), int(n), int(prompt), int(new)))
    return shapes


def attention_step(prompts: int, n: int, prompt: int, new: int, cascade: bool):
    """A function timing one pass: the mean seconds of one decode step's attention over
    :data:`LAYERS` layers, at 8 positions spread over the decode."""
    count = prompts * n
    torch.manual_seed(0)
    cache = SlotKVCache(LAYERS, count, KV_HEADS, prompt + new, HEAD_DIM, torch.float32, torch.device("cpu"))
    for tensor in cache.keys + cache.values:
        tensor.normal_()
    groups = [list(range(g * n, (g + 1) * n)) for g in range(prompts)]
    shared = (
        SharedPrefixes.from_groups(groups, [g[0] for g in groups], [prompt] * prompts) if cascade else None
    )
    query = torch.randn(count, HEADS, HEAD_DIM)
    key, value = torch.randn(count, KV_HEADS, HEAD_DIM), torch.randn(count, KV_HEADS, HEAD_DIM)
    offsets = sorted({min(new - 1, i * new // 8) for i in range(8)})

    def one_pass() -> float:
        start = time.perf_counter()
        for offset in offsets:
            plan = StepPlan(cache, (), 0, torch.full((count,), prompt + offset), shared)
            for layer in range(LAYERS):
                decode_step_attention(plan, layer, query, key, value, HEAD_DIM**-0.5)
        return (time.perf_counter() - start) / len(offsets)

    return one_pass


def interleaved_best(fns: dict, repeats: int) -> dict:
    """The fastest of ``repeats`` timings of each function, run in turn (after one warm-up
    each): on a shared machine the minimum is the least disturbed estimate of the cost."""
    for fn in fns.values():
        fn()
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(fn())
    return {name: min(t) for name, t in times.items()}


def attention_table(shapes, repeats: int) -> None:
    print("| prompts x n | prompt | new | plain ms/step | cascade ms/step | cascade/plain | rule says |")
    print("|---|---|---|---|---|---|---|")
    for prompts, n, prompt, new in shapes:
        best = interleaved_best(
            {
                mode: attention_step(prompts, n, prompt, new, mode == "cascade")
                for mode in ("plain", "cascade")
            },
            repeats,
        )
        plain, cascade = best["plain"], best["cascade"]
        rule = "cascade" if worth_sharing([prompt] * prompts, [n] * prompts) else "plain"
        print(
            f"| {prompts}x{n} | {prompt} | {new} | {plain * 1e3:.2f} | {cascade * 1e3:.2f} | "
            f"{cascade / plain:.2f} | {rule} |",
            flush=True,
        )


def engine_table(shapes, repeats: int) -> None:
    from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, RolloutRequest, SamplingParams

    path = smollm2_dir()
    engines = {
        share: NativeRolloutEngine.from_pretrained(
            path, NativeEngineConfig(max_num_seqs=256, max_model_len=1024, share_prefix_reads=share)
        )
        for share in (False, True)
    }
    print("| prompts x n | prompt | new | plain tok/s | cascade tok/s | cascade/plain | engine chose |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for prompts, n, prompt, new in shapes:
        ids = [tuple(torch.randint(100, 40_000, (prompt,), generator=gen).tolist()) for _ in range(prompts)]
        params = SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True)
        requests = [RolloutRequest(f"r{i}", ids[i // n], params) for i in range(prompts * n)]
        rates: dict[bool, list[float]] = {False: [], True: []}
        chose = "plain"
        for run in range(repeats + 1):  # the first run of each is a warm-up
            for share, engine in engines.items():
                before = engine.stats.shared_prefix_steps
                start = time.perf_counter()
                done = engine.generate_batch(requests, timeout=3600)
                seconds = time.perf_counter() - start
                if share and engine.stats.shared_prefix_steps > before:
                    chose = "cascade"
                if run:
                    rates[share].append(sum(len(c.token_ids) for c in done) / seconds)
        plain, cascade = statistics.median(rates[False]), statistics.median(rates[True])
        print(
            f"| {prompts}x{n} | {prompt} | {new} | {plain:,.0f} | {cascade:,.0f} | {cascade / plain:.2f} | {chose} |",
            flush=True,
        )
    for engine in engines.values():
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--level", choices=["attention", "engine"], default="attention")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(describe_machine())
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    shapes = parse_shapes(args.shapes)
    (attention_table if args.level == "attention" else engine_table)(shapes, args.repeats)


if __name__ == "__main__":
    main()
