"""Training tokens/s: packing + token-budget micro-batches vs padded fixed-size micro-batches.

Both engines train the same ~3M-parameter Qwen2-family model on the same global batches of
64 sequences whose lengths follow a long-tailed distribution between 16 and 512 tokens.
The baseline runs micro-batches of 8 sequences, each padded to its own longest row; the
packed engine concatenates valid tokens into micro-batches of at most 4096 tokens,
balanced with Karmarkar-Karp. One step = forward + backward + optimizer step. Reported:
valid (non-padding) tokens per second, median of --repeats timed steps after a warm-up,
and the ratio from this one run.

    python bench/train_throughput.py [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.models import TinyModelConfig, build_tiny_model
from tandem.protocol import Batch
from tandem.sft.loss import sft_loss

BENCH_MODEL = TinyModelConfig(
    family="qwen2", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768
)


def long_tailed_batch(seed: int, size: int = 64, low: int = 16, high: int = 512) -> Batch:
    """Log-normal lengths clipped to [low, high] (median ~70, a few near 512), random token ids."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(size, generator=gen) * 0.8 + 4.25).round().clamp(low, high).long()
    width = int(lengths.max())
    mask = (torch.arange(width) < lengths[:, None]).long()
    ids = torch.randint(6, 103, (size, width), generator=gen) * mask
    return Batch({"input_ids": ids, "attention_mask": mask, "loss_mask": mask})


def time_steps(engine: TorchTrainEngine, batches: list[Batch]) -> list[float]:
    rates = []
    for batch in batches:
        start = time.perf_counter()
        normalizer = engine.global_normalizer(batch["loss_mask"])
        engine.forward_backward(batch, functools.partial(sft_loss, normalizer=normalizer))
        engine.optimizer_step()
        rates.append(int(batch["attention_mask"].sum()) / (time.perf_counter() - start))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [long_tailed_batch(seed) for seed in range(args.repeats + 1)]
    lengths = torch.cat([b["attention_mask"].sum(-1) for b in batches]).float()
    print(
        f"model {sum(p.numel() for p in build_tiny_model(BENCH_MODEL, 103, 0, 1, 4).parameters()) / 1e6:.1f}M params; "
        f"lengths min {int(lengths.min())} median {int(lengths.median())} mean {lengths.mean():.0f} max {int(lengths.max())}; "
        f"{args.threads} threads"
    )
    results = {}
    settings = {
        "padded, 8 sequences per micro-batch": EngineConfig(use_packing=False, micro_batch_size=8, lr=1e-4),
        "packed, 4096-token budget": EngineConfig(use_packing=True, max_tokens_per_micro_batch=4096, lr=1e-4),
    }
    for name, config in settings.items():
        engine = TorchTrainEngine(config, model=build_tiny_model(BENCH_MODEL, 103, 0, 1, 4))
        engine.initialize()
        time_steps(engine, batches[:1])  # warm-up
        rates = time_steps(engine, batches[1:])
        results[name] = statistics.median(rates)
        print(
            f"{name:40s} median {results[name]:10,.0f} tok/s  (runs: {', '.join(f'{r:,.0f}' for r in rates)})"
        )
    padded, packed = results.values()
    print(f"ratio packed / padded: {packed / padded:.2f}x")


if __name__ == "__main__":
    main()
