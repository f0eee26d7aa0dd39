"""One decode step's sampling (``tandem.rollout.sampling.draw_step``) against the same draw with
the work it skips forced back in, side by side in one run.

``draw_step`` knows each row's settings on the host. When every temperature is 1 or 0 it divides
nothing (``x / 1`` is ``x``); without greedy rows it takes no argmax; without top-k/top-p it sorts
nothing. The baseline draws the same rows through the sampler's pieces with a temperature tensor
of ones and a greedy mask of zeros, so it divides and takes the argmax, as every step did before
(both build the CDF in place, which the previous code did not: docs/benchmarks.md has that A/B too).
Both give the same tokens and log-probs (checked here). The step table prints the milliseconds
per step (medians, the two alternating) and their ratio, for shapes of SmolLM2 (vocabulary
49,152) and Qwen2.5 (151,936), on one thread with the tuned allocator, as the native engine runs.

    python bench/sampler_step.py [--repeats 21]
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

from tandem.kernels.cpu.allocator import tune_cpu_allocator  # noqa: E402
from tandem.protocol.generation import SamplingParams  # noqa: E402
from tandem.rollout.sampling import counter_uniforms, draw_step, draw_tokens, processed_logits  # noqa: E402

SHAPES = ((16, 49_152), (64, 49_152), (256, 151_936))  # (decode batch, vocabulary)


def forced(logits: torch.Tensor, seeds: list[int], steps: list[int]) -> tuple[list[int], list[float]]:
    """The draw of temperature-1 rows with the division and the greedy argmax done anyway."""
    rows = logits.shape[0]
    processed = processed_logits(logits, torch.ones(rows), None, None)
    uniforms = counter_uniforms(torch.tensor(seeds), torch.tensor(steps))
    tokens, _ = draw_tokens(processed, torch.zeros(rows, dtype=torch.bool), uniforms)
    log_probs = torch.log_softmax(processed, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens.tolist(), log_probs.double().tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=21, help="timed steps of each, alternating")
    args = parser.parse_args()
    tune_cpu_allocator()
    torch.set_num_threads(1)
    print(describe_machine())
    print(f"{'batch x vocab':>16} | {'forced ms':>9} | {'draw_step ms':>12} | {'ratio':>5}")
    for rows, vocab in SHAPES:
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 3
        params = [SamplingParams(temperature=1.0)] * rows
        seeds, steps = list(range(rows)), [5] * rows
        draws = draw_step(logits, params, seeds, steps)
        if forced(logits, seeds, steps) != (draws.tokens, draws.log_probs):
            raise SystemExit(f"[{rows}, {vocab}]: draw_step and the forced draw disagree")
        times: dict[str, list[float]] = {"forced": [], "draw_step": []}
        repeats = max(3, args.repeats // 3) if vocab > 100_000 else args.repeats
        runs = {"forced": (forced, (logits, seeds, steps)), "draw_step": (draw_step, (logits, params, seeds, steps))}
        for _ in range(repeats):
            for name, (run, run_args) in runs.items():
                start = time.perf_counter()
                run(*run_args)
                times[name].append(time.perf_counter() - start)
        base, ours = (statistics.median(times[name]) * 1e3 for name in ("forced", "draw_step"))
        print(f"{f'{rows} x {vocab}':>16} | {base:>9.2f} | {ours:>12.2f} | {ours / base:>5.2f}")


if __name__ == "__main__":
    main()
