"""The log-prob head's forward + backward at SmolLM2's shape: the fused head against the heads before it.

Sides (``--sides``), all fp32, the same hidden states, weight, labels and upstream gradients:

* ``fused``: ``log_probs_from_hidden`` as the trainer calls it (``ChunkedSoftmaxHead``: no
  logits saved; backward recomputes each chunk's logits, turns them into their gradient in
  place and adds the chunk's share into one head-weight gradient with ``addmm_``);
* ``checkpointed``: the head it replaced (tandem at 9c9ee5e): chunks of ``--chunk-size`` rows,
  each under activation checkpointing, products through ``tandem.kernels.cpu.linear`` (oneDNN)
  forward and backward, one ``[V, H]`` weight gradient per chunk added up by autograd;
* ``plain``: the textbook head, ``F.linear`` over all rows (full ``[N, V]`` logits), then
  ``log_softmax``, a gather and the entropy under plain autograd (HF's and TRL's path); only up
  to ``--plain-max-tokens`` rows (it holds several ``[N, V]`` fp32 tensors).

The loss reaches both outputs (``sum(log_probs * g0) + sum(entropy * g1)``, random ``g``), as
a policy-gradient loss with an entropy term does. Each side does one untimed warm-up per token
count; then ``--rounds`` rounds, each timing every (tokens, side) once, the sides' order
alternating from round to round, so a loaded machine's slow spells hit all sides alike. The
time is the median over rounds; the ratio ``side / fused`` is of those medians (and, beside
it, of the fastest rounds: on a loaded machine the least disturbed). Peak memory:
glibc's bytes in use (``mallinfo2``) after every operator of one extra forward + backward,
above the inputs (hidden states, weight, labels, upstream), in MiB; logits of one token row
are ``V x 4`` bytes.

    python bench/logprob_head.py [--tokens 2048,4096,8192] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

from tandem.kernels.cpu.allocator import tune_cpu_allocator  # noqa: E402
from tandem.kernels.cpu.linear import active_backend  # noqa: E402
from tandem.models.logprobs import chunk_rows, head_logits, log_probs_from_hidden, softmax_outputs  # noqa: E402

HIDDEN, VOCAB = 576, 49_152  # SmolLM2-135M's final hidden size and vocabulary


def fused_head(hidden, weight, labels, chunk_size: int):
    outputs = log_probs_from_hidden(hidden, weight, labels, chunk_size=chunk_size)
    return outputs.log_probs, outputs.entropy


def _old_chunk(hidden, weight, labels):
    return softmax_outputs(head_logits(hidden, weight, 1.0, None), labels, False)


def checkpointed_head(hidden, weight, labels, chunk_size: int):
    """tandem's head before the fused one: per chunk of rows, checkpointed; ``[N]`` each."""
    chunks = [
        checkpoint(_old_chunk, hidden[start : start + chunk_size], weight, labels[start : start + chunk_size],
                   use_reentrant=False)
        for start in range(0, hidden.shape[0], chunk_size)
    ]  # fmt: skip
    return tuple(torch.cat(part) for part in zip(*chunks, strict=True))


def plain_head(hidden, weight, labels, chunk_size: int):
    """Full ``[N, V]`` logits, ``log_softmax``, gather, entropy: ``[N]`` each."""
    log_p = torch.log_softmax(F.linear(hidden, weight), dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


SIDES = {"fused": fused_head, "checkpointed": checkpointed_head, "plain": plain_head}


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")
    ]  # fmt: skip


def malloc_in_use():
    """glibc's bytes in use now (heap and mmapped blocks), or None without ``mallinfo2``."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    return lambda: mallinfo2().uordblks + mallinfo2().hblkhd


class PeakBytes(TorchDispatchMode):
    """The most bytes ``malloc`` had handed out after any operator inside the block."""

    def __init__(self, in_use) -> None:
        super().__init__()
        self.in_use, self.peak = in_use, in_use()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.in_use())
        return out


def inputs(tokens: int, seed: int = 0):
    """``hidden [N, H]``, ``weight [V, H]`` (both leaves), ``labels [N]``, ``upstream [N, 2]``."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=gen).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).requires_grad_()
    labels = torch.randint(0, VOCAB, (tokens,), generator=gen)
    return hidden, weight, labels, torch.randn(tokens, 2, generator=gen)


def step(side: str, leaves, chunk_size: int) -> None:
    """One forward + backward of ``side``; leaves' gradients cleared first."""
    hidden, weight, labels, upstream = leaves
    hidden.grad = weight.grad = None
    log_probs, entropy = SIDES[side](hidden, weight, labels, chunk_size)
    ((log_probs * upstream[:, 0]).sum() + (entropy * upstream[:, 1]).sum()).backward()


def timed(side: str, leaves, chunk_size: int) -> float:
    start = time.perf_counter()
    step(side, leaves, chunk_size)
    return time.perf_counter() - start


def peak_mib(side: str, leaves, chunk_size: int, in_use) -> float | None:
    """Peak bytes above the inputs over one forward + backward (the leaves' gradients count)."""
    if in_use is None:
        return None
    leaves[0].grad = leaves[1].grad = None
    start = in_use()
    with PeakBytes(in_use) as meter:
        step(side, leaves, chunk_size)
    return (meter.peak - start) / 2**20


def sides_for(tokens: int, args: argparse.Namespace) -> list[str]:
    return [s for s in args.sides.split(",") if s != "plain" or tokens <= args.plain_max_tokens]


def measure(args: argparse.Namespace) -> dict[tuple[int, str], dict]:
    """``{(tokens, side): {"times": [s per round], "peak_mib": MiB}}``."""
    token_counts = [int(t) for t in args.tokens.split(",")]
    data = {tokens: inputs(tokens) for tokens in token_counts}
    in_use = malloc_in_use()
    results: dict[tuple[int, str], dict] = {}
    for tokens in token_counts:
        for side in sides_for(tokens, args):
            timed(side, data[tokens], args.chunk_size)  # warm-up
            results[tokens, side] = {
                "times": [],
                "peak_mib": peak_mib(side, data[tokens], args.chunk_size, in_use),
            }
    for round_ in range(args.rounds):
        for tokens in token_counts:
            order = sides_for(tokens, args)
            for side in order if round_ % 2 == 0 else reversed(order):
                results[tokens, side]["times"].append(timed(side, data[tokens], args.chunk_size))
        print(f"round {round_ + 1} done at {time.strftime('%H:%M:%S')}, load {load()}", flush=True)
    return results


def load() -> str:
    return ", ".join(f"{v:.1f}" for v in os.getloadavg())


def print_table(results: dict[tuple[int, str], dict], args: argparse.Namespace) -> None:
    sides = args.sides.split(",")
    others = [s for s in sides if s != "fused"]
    print(
        "| tokens | "
        + " | ".join(f"{s} s" for s in sides)
        + " | "
        + " | ".join(f"{s} / fused" for s in others)
        + " | "
        + " | ".join(f"{s} / fused (min)" for s in others)
        + " | "
        + " | ".join(f"{s} peak MiB" for s in sides)
        + " |"
    )
    print("|---" * (1 + 2 * len(sides) + 2 * len(others)) + "|")
    for tokens in sorted({t for t, _ in results}):
        got = {s: results[tokens, s] for s in sides if (tokens, s) in results}
        median = {s: statistics.median(r["times"]) for s, r in got.items()}
        times = " | ".join(f"{median[s]:.3f}" if s in got else "-" for s in sides)
        least = {s: min(r["times"]) for s, r in got.items()}
        ratios = " | ".join(f"{median[s] / median['fused']:.2f}x" if s in got else "-" for s in others)
        ratios += " | " + " | ".join(f"{least[s] / least['fused']:.2f}x" if s in got else "-" for s in others)
        peaks = " | ".join(
            f"{got[s]['peak_mib']:,.0f}" if s in got and got[s]["peak_mib"] is not None else "-"
            for s in sides
        )
        print(f"| {tokens:,} | {times} | {ratios} | {peaks} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="2048,4096,8192", help="rows of hidden states, comma-separated")
    parser.add_argument("--sides", default="fused,checkpointed,plain", help=f"of {', '.join(SIDES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=1024, help="rows per chunk (logprob_chunk_size)")
    parser.add_argument("--plain-max-tokens", type=int, default=4096)
    args = parser.parse_args()
    unknown = set(args.sides.split(",")) - set(SIDES)
    if unknown or "fused" not in args.sides.split(","):
        raise SystemExit(
            f"--sides: {sorted(unknown)} unknown; choose from {', '.join(SIDES)}, fused included"
        )
    torch.set_num_threads(args.threads)
    tuned = tune_cpu_allocator()  # as the training engine does on CPU
    print(describe_machine())
    print(
        f"hidden {HIDDEN}, vocabulary {VOCAB:,}, fp32; fused chunk {chunk_rows(args.chunk_size, VOCAB)} rows, "
        f"checkpointed chunk {args.chunk_size} rows; linear backend {active_backend()}; malloc tuning {tuned}; "
        f"median of {args.rounds} rounds; load at start {load()}"
    )
    print_table(measure(args), args)


if __name__ == "__main__":
    main()
