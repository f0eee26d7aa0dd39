"""The CPU's physical limits and how close SmolLM2-135M-Instruct's update and decode come to them.

In one run: the machine line; the peaks — fp32 matmul GFLOP/s (the best of PyTorch's ``mm``
and tandem's oneDNN linear), bf16 matmul GFLOP/s (``mm`` on bf16, oneDNN's bf16 kernels), both
on ``--matmul-size`` square products at ``--threads`` threads, and memcpy bandwidth at 1 and
``--threads`` threads (bytes read + bytes written per second, as STREAM's Copy counts it); then
SmolLM2 (a GGUF file de-quantized to fp32, docs/models.md):

* a GRPO-shaped batch: 8 chat-templated arithmetic prompts x 4 responses sampled by the native
  rollout engine (fp32, temperature 1, <= 32 new tokens);
* the actor update (forward + backward of a policy-gradient loss + AdamW, shared prompts) timed
  in fp32 and under ``mixed_precision=bf16``, alternating, median of ``--steps`` after one warm-up:
  achieved FLOP/s = 6 x parameters x tokens computed / seconds, as a fraction of the matching peak;
* the rollout/trainer log-prob gap (``rollout_corr/*`` of :func:`tandem.algos.rollout_correction.
  mismatch_metrics`, with max and mean |delta|) of the fp32 and the bf16 trainer against the fp32
  rollout, and of the bf16 trainer against a bf16 rollout;
* decode's achieved weight bandwidth: parameters x bytes per parameter x decode steps / decode
  seconds (32 sequences, 32 tokens ignoring EOS, minus a 1-token run: the prefill), fp32 and bf16
  native engines, as a fraction of memcpy bandwidth.

With ``--profile`` each figure under its target (update >= 50% of the matmul peak, decode >=
50% of the bandwidth) gets one more run under ``torch.profiler`` (top operators printed).

    python bench/real_model_limits.py [--steps 3] [--threads 2] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402
from phase_profile import profile_phase  # noqa: E402

from tandem.algos.rollout_correction import mismatch_metrics  # noqa: E402
from tandem.device import cpu_bf16_instructions  # noqa: E402
from tandem.engine import EngineConfig, TorchTrainEngine  # noqa: E402
from tandem.kernels.cpu.linear import linear  # noqa: E402
from tandem.models import load_tokenizer  # noqa: E402
from tandem.models.gguf import resolve_model_path  # noqa: E402
from tandem.models.packaged import SMOLLM2_INSTALL_HINT, smollm2_gguf_path  # noqa: E402
from tandem.protocol import Batch  # noqa: E402
from tandem.protocol.sequences import sequence_tensors  # noqa: E402
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, RolloutRequest, SamplingParams  # noqa: E402

PROMPTS, RESPONSES, NEW_TOKENS, TARGET = 8, 4, 32, 0.5


def best_seconds(work: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``work`` after one warm-up (the least disturbed one)."""
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_peaks(size: int, repeats: int) -> dict[str, float]:
    """GFLOP/s of ``[size, size] @ [size, size]``: fp32 through ``mm`` and oneDNN, bf16 through ``mm``."""
    flops = 2.0 * size**3
    a, b = torch.randn(size, size), torch.randn(size, size)
    peaks = {
        "fp32 mm": flops / best_seconds(lambda: torch.mm(a, b), repeats) / 1e9,
        "fp32 oneDNN": flops / best_seconds(lambda: linear(a, b), repeats) / 1e9,
    }
    a16, b16 = a.bfloat16(), b.bfloat16()
    peaks["bf16 mm"] = flops / best_seconds(lambda: torch.mm(a16, b16), repeats) / 1e9
    return peaks


def memcpy_gb_per_s(threads: int, megabytes: int, repeats: int) -> float:
    """Bytes read + written per second copying a ``megabytes`` buffer at ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    source = torch.ones(megabytes << 20, dtype=torch.uint8)
    target = torch.empty_like(source)
    seconds = best_seconds(lambda: target.copy_(source), repeats)
    torch.set_num_threads(before)
    return 2 * source.numel() / seconds / 1e9


def arithmetic_prompts(tokenizer) -> list[list[int]]:
    """``PROMPTS`` arithmetic questions, each one user turn under the chat template."""
    gen = torch.Generator().manual_seed(0)
    numbers = torch.randint(10, 1000, (PROMPTS, 2), generator=gen).tolist()
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}? Think step by step, then give the answer."}],
            add_generation_prompt=True,
            return_dict=False,
        )  # fmt: skip
        for a, b in numbers
    ]


def rollout(engine: NativeRolloutEngine, prompts: list[list[int]], **sampling) -> list:
    """``RESPONSES`` seeded samples of each prompt (temperature 1 unless ``sampling`` says otherwise)."""
    requests = [
        RolloutRequest(f"{p}-{r}", tuple(prompt), SamplingParams(seed=p * RESPONSES + r, **sampling))
        for p, prompt in enumerate(prompts)
        for r in range(RESPONSES)
    ]
    return engine.generate_batch(requests)


def decode_figures(model_dir: str, dtype: str, prompts: list[list[int]], params: int, repeats: int) -> dict:
    """Decode seconds per step of ``PROMPTS x RESPONSES`` sequences and the weight bytes it streams."""
    config = NativeEngineConfig(max_num_seqs=PROMPTS * RESPONSES, max_model_len=256, dtype=dtype)
    engine = NativeRolloutEngine.from_pretrained(model_dir, config)
    full = best_seconds(lambda: rollout(engine, prompts, max_tokens=NEW_TOKENS, ignore_eos=True), repeats)
    prefill = best_seconds(lambda: rollout(engine, prompts, max_tokens=1, ignore_eos=True), repeats)
    step = (full - prefill) / (NEW_TOKENS - 1)
    weight_bytes = params * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return {"engine": engine, "step_s": step, "gb_per_s": weight_bytes / step / 1e9}


def grpo_batch(prompts: list[list[int]], completions: list, pad_id: int) -> Batch:
    """The update's batch: the rollout's tokens and log-probs, a fixed advantage per response."""
    prompt_ids = [prompt for prompt in prompts for _ in range(RESPONSES)]
    batch = Batch(sequence_tensors(prompt_ids, completions, pad_id))
    gen = torch.Generator().manual_seed(1)
    advantages = torch.randn(len(completions), 1, generator=gen)
    return batch.union(
        Batch({"advantages": advantages.expand_as(batch["response_mask"]).contiguous().float()})
    )


def policy_gradient_loss(micro: Batch, outputs):
    """``-mean(advantage * log p)`` over response tokens (the shape of a GRPO loss)."""
    width = micro["prompts"].shape[1]
    mask = micro["response_mask"].float()
    return -(micro["advantages"] * outputs.log_probs[:, width:] * mask).sum() / mask.sum(), {}


def computed_tokens(batch: Batch) -> int:
    """Tokens the shared-prompt update computes: each prompt once, then every response."""
    prompt_tokens = batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(-1)
    return int(
        prompt_tokens[::RESPONSES].sum() + batch["attention_mask"][:, batch["prompts"].shape[1] :].sum()
    )


def update_seconds(engine: TorchTrainEngine, batch: Batch) -> float:
    start = time.perf_counter()
    engine.forward_backward(batch, policy_gradient_loss)
    engine.optimizer_step()
    return time.perf_counter() - start


def log_prob_gap(engine: TorchTrainEngine, batch: Batch, rollout_log_probs: torch.Tensor) -> dict[str, float]:
    """``rollout_corr/*`` of the trainer's log-probs against the rollout's, and the mean |delta|."""
    width = batch["prompts"].shape[1]
    trainer = engine.forward_backward(batch, None, forward_only=True).outputs.log_probs[:, width:]
    mask = batch["response_mask"].float()
    metrics = {
        name: float(value) for name, value in mismatch_metrics(trainer, rollout_log_probs, mask).items()
    }
    metrics["mean_abs_log_prob_diff"] = float(((trainer - rollout_log_probs).abs() * mask).sum() / mask.sum())
    return metrics


def print_gap(label: str, gap: dict[str, float]) -> None:
    print(
        f"log-prob gap {label}: max |d| {gap['rollout_corr/max_abs_log_prob_diff']:.2e}, mean |d| "
        f"{gap['mean_abs_log_prob_diff']:.2e}, rollout_corr/kl {gap['rollout_corr/kl']:.2e}, "
        f"k3_kl {gap['rollout_corr/k3_kl']:.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--matmul-size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gguf = smollm2_gguf_path()
    if gguf is None:
        raise SystemExit(f"this benchmark needs SmolLM2: {SMOLLM2_INSTALL_HINT}")
    print(describe_machine())
    print(f"bf16 matrix instructions: {cpu_bf16_instructions()}")
    peaks = matmul_peaks(args.matmul_size, args.repeats)
    fp32_peak, bf16_peak = max(peaks["fp32 mm"], peaks["fp32 oneDNN"]), peaks["bf16 mm"]
    print(
        f"matmul {args.matmul_size}^2, {args.threads} threads: "
        + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peaks.items())
    )
    bandwidth = {threads: memcpy_gb_per_s(threads, 512, args.repeats) for threads in (1, args.threads)}
    print("memcpy (read + write): " + ", ".join(f"{t} thread(s) {v:.1f} GB/s" for t, v in bandwidth.items()))

    model_dir = resolve_model_path(str(gguf))
    tokenizer = load_tokenizer(model_dir)
    prompts = arithmetic_prompts(tokenizer)
    engines = {
        precision: TorchTrainEngine(
            EngineConfig(model_path=model_dir, device="cpu", mixed_precision=precision, lr=1e-6)
        )
        for precision in ("none", "bf16")
    }
    for engine in engines.values():
        engine.initialize()
    params = sum(p.numel() for p in engines["none"].module.parameters())
    decode = {
        dtype: decode_figures(model_dir, dtype, prompts, params, args.repeats)
        for dtype in ("float32", "bfloat16")
    }
    completions = rollout(decode["float32"]["engine"], prompts, max_tokens=NEW_TOKENS)
    batch = grpo_batch(prompts, completions, tokenizer.pad_token_id)
    tokens = computed_tokens(batch)
    print(
        f"SmolLM2: {params / 1e6:.1f}M parameters; update batch {PROMPTS} x {RESPONSES}: "
        f"{int(batch['response_mask'].sum())} response tokens, {tokens} tokens computed (each prompt once)"
    )
    rollout_fp32 = batch["rollout_log_probs"]
    print_gap("trainer fp32 vs rollout fp32", log_prob_gap(engines["none"], batch, rollout_fp32))
    print_gap("trainer bf16 vs rollout fp32", log_prob_gap(engines["bf16"], batch, rollout_fp32))
    bf16_rollout = rollout(decode["bfloat16"]["engine"], prompts, max_tokens=NEW_TOKENS)
    bf16_batch = grpo_batch(prompts, bf16_rollout, tokenizer.pad_token_id)
    print_gap(
        "trainer bf16 vs rollout bf16",
        log_prob_gap(engines["bf16"], bf16_batch, bf16_batch["rollout_log_probs"]),
    )

    times: dict[str, list[float]] = {"none": [], "bf16": []}
    for step in range(args.steps + 1):
        for precision in ("none", "bf16") if step % 2 else ("bf16", "none"):
            seconds = update_seconds(engines[precision], batch)
            if step:  # the first step of each warms it up
                times[precision].append(seconds)
    fractions = {}
    for precision, peak in (("none", fp32_peak), ("bf16", bf16_peak)):
        seconds = statistics.median(times[precision])
        achieved = 6 * params * tokens / seconds / 1e9
        fractions[precision] = achieved / peak
        print(
            f"update {'fp32' if precision == 'none' else 'bf16'}: {seconds:.2f} s, {achieved:.0f} GFLOP/s = "
            f"{fractions[precision]:.0%} of the {peak:.0f} GFLOP/s peak"
        )
    print(
        f"update bf16 / fp32 speed: {statistics.median(times['none']) / statistics.median(times['bf16']):.2f}x"
    )
    for dtype, figures in decode.items():
        fraction = figures["gb_per_s"] / bandwidth[args.threads]
        figures["fraction"] = fraction
        print(
            f"decode {dtype} ({PROMPTS * RESPONSES} sequences): {figures['step_s'] * 1e3:.1f} ms/step, weights at "
            f"{figures['gb_per_s']:.1f} GB/s = {fraction:.0%} of memcpy"
        )
    if args.profile:
        out = tempfile.mkdtemp(prefix="real_model_limits_")
        for precision, fraction in fractions.items():
            if fraction < TARGET:
                profile_phase(
                    lambda p=precision: update_seconds(engines[p], batch),
                    torch.device("cpu"),
                    f"update_{precision}",
                    out,
                )
        for dtype, figures in decode.items():
            if figures["fraction"] < TARGET:
                engine = figures["engine"]
                profile_phase(
                    lambda e=engine: rollout(e, prompts, max_tokens=8, ignore_eos=True),
                    torch.device("cpu"),
                    f"decode_{dtype}",
                    out,
                )
    for figures in decode.values():
        figures["engine"].close()


if __name__ == "__main__":
    main()
