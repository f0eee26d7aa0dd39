"""fp32 linear layers on CPU: oneDNN (tandem's default) vs PyTorch's default BLAS (``F.linear``).

Shapes are those of the benchmark models (tiny: hidden 256, MLP 768; small: hidden 512, MLP
1536). ``train`` rows time forward + backward of one layer over a packed micro-batch of
tokens; ``decode`` rows time the forward of all seven linears of a small-model layer for 8
layers (weights out of cache, as in a real decode step) at the given batch. Both backends run
interleaved inside every repeat; the median of ``--repeats`` is printed with the ratio.

    python bench/cpu_linear.py [--repeats 9] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tandem.kernels.cpu.linear import active_backend, cpu_linear_backend, linear

SMALL_LAYER = [(512, 512), (256, 512), (256, 512), (512, 512), (1536, 512), (1536, 512), (512, 1536)]


def interleaved_ms(work: Callable[[], None], repeats: int) -> dict[str, float]:
    """Median milliseconds of ``work`` under each backend, alternating backends inside each repeat."""
    times: dict[str, list[float]] = {"onednn": [], "torch": []}
    for backend in times:  # warm-up (kernel selection, allocations)
        with cpu_linear_backend(backend):
            work()
    for _ in range(repeats):
        for backend, out in times.items():
            with cpu_linear_backend(backend):
                start = time.perf_counter()
                work()
                out.append((time.perf_counter() - start) * 1e3)
    return {backend: statistics.median(values) for backend, values in times.items()}


def train_work(tokens: int, fan_in: int, fan_out: int) -> Callable[[], None]:
    x = torch.randn(tokens, fan_in, requires_grad=True)
    weight = torch.randn(fan_out, fan_in, requires_grad=True)
    upstream = torch.randn(tokens, fan_out)

    def work() -> None:
        x.grad = weight.grad = None
        linear(x, weight).backward(upstream)

    return work


def decode_work(batch: int) -> Callable[[], None]:
    weights = [torch.randn(out, fan_in) for _ in range(8) for out, fan_in in SMALL_LAYER]  # ~100 MB
    inputs = {fan_in: torch.randn(batch, fan_in) for _, fan_in in SMALL_LAYER}

    @torch.inference_mode()
    def work() -> None:
        for weight in weights:
            linear(inputs[weight.shape[1]], weight)

    return work


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if active_backend() != "onednn":
        raise SystemExit("oneDNN is not available (or TANDEM_CPU_LINEAR=torch): nothing to compare")
    print(f"{'case':34s} {'torch ms':>9s} {'oneDNN ms':>10s} {'speed-up':>9s}")
    cases = [
        (f"train fwd+bwd {t} tok {i}->{o}", train_work(t, i, o))
        for t in (1200, 4800)
        for i, o in ((256, 768), (768, 256), (512, 1536))
    ] + [(f"decode 8 small layers, batch {b}", decode_work(b)) for b in (1, 4, 16, 64, 256)]
    for name, work in cases:
        ms = interleaved_ms(work, args.repeats)
        print(f"{name:34s} {ms['torch']:9.2f} {ms['onednn']:10.2f} {ms['torch'] / ms['onednn']:8.2f}x")


if __name__ == "__main__":
    main()
