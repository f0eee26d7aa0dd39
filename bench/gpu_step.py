"""One GRPO step of a Qwen2.5-0.5B-shaped model on a GPU: generation and update speed, MFU, memory.

The model is built from a config with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query /
2 key-value heads, MLP 4864, vocabulary 151,936, tied embeddings; ~494M parameters), randomly
initialised — nothing is downloaded. The step's two phases run as the RL worker runs them:

- **generation**: the native engine in bf16 on the GPU, ``--prompts`` prompts x ``--n``
  responses (a decode batch of ``prompts * n``, 256 by default), each ``--new-tokens`` long
  (EOS ignored, so every sequence runs to the end). Reported: tokens/s, the decode phase's
  achieved memory bandwidth (every decode step reads the weights once and each running
  sequence's KV cache), and its MFU.
- **update**: one actor update (GRPO loss, fp32 head) over the generated sequences with the
  torch engine: bf16 compute (autocast), fp32 master weights and AdamW, packed sequences in
  token-budget micro-batches. Reported: tokens/s and MFU (6 x parameters x tokens, plus the
  attention products).
- **offload**: after the update, the actor's parameters and AdamW state go to the CPU and back
  (what ``actor.offload.params`` / ``optimizer`` do around generation). Reported: seconds each
  way and the GPU memory the offload freed.

``--profile DIR`` then runs each phase once more under ``torch.profiler`` (see
``bench/phase_profile.py``): the operators that took the time, and how busy the GPU was —
the profile that says why a goal is missed.

Peak GPU memory per phase comes from ``torch.cuda.max_memory_allocated``. MFU is against
``--peak-tflops`` (the dense bf16 peak; 989 for an H100 SXM or H200) and bandwidth against
``--peak-gbps`` (3350 GB/s for an H100 SXM's HBM3, 4800 for an H200's HBM3e); left out, both
come from the GPU's name (``PEAKS``). ``update_mfu_bound_fp32_head`` is the
best MFU the update could reach with its log-prob head in fp32 (8 x tokens x hidden x vocab
FLOPs at ``--peak-fp32-tflops``, 67 for an H100 SXM; everything else at the bf16 peak);
``--head-dtype bfloat16`` runs the head on tensor cores instead (bf16 inputs, fp32 sums). The goals (issue #18): update MFU >= 35%,
decode bandwidth >= 30%.

    python bench/gpu_step.py [--prompts 32 --n 8 --prompt-tokens 128 --new-tokens 256] [--head-dtype bfloat16]
    python bench/gpu_step.py --device cpu --layers 2 --hidden 128 --heads 4 --kv-heads 2 \\
        --intermediate 384 --vocab 1024 --prompts 4 --n 2 --new-tokens 8   # a smoke run without a GPU
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from phase_profile import profile_phase

from tandem.algos import LossNormalizer, PolicyLossConfig
from tandem.device import bind_device
from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.engine.varlen_attention import ROUTES
from tandem.kernels.cuda.varlen import installed_varlen_kernel
from tandem.models import TinyModelConfig, build_tiny_model
from tandem.models.tokenizer import build_char_tokenizer
from tandem.protocol import Batch
from tandem.protocol.sequences import sequence_tensors
from tandem.rl.actor_loss import make_actor_loss
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, RolloutRequest, SamplingParams


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    shape = parser.add_argument_group("model shape (Qwen2.5-0.5B by default)")
    shape.add_argument("--layers", type=int, default=24)
    shape.add_argument("--hidden", type=int, default=896)
    shape.add_argument("--heads", type=int, default=14)
    shape.add_argument("--kv-heads", type=int, default=2)
    shape.add_argument("--intermediate", type=int, default=4864)
    shape.add_argument("--vocab", type=int, default=151_936)
    work = parser.add_argument_group("the step")
    work.add_argument("--prompts", type=int, default=32)
    work.add_argument("--n", type=int, default=8, help="responses per prompt")
    work.add_argument("--prompt-tokens", type=int, default=128)
    work.add_argument("--new-tokens", type=int, default=256)
    work.add_argument("--micro-batch-tokens", type=int, default=32_768)
    work.add_argument("--warmup", type=int, default=1, help="untimed rounds of each phase first")
    work.add_argument(
        "--head-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the update's log-prob head product (EngineConfig.logprob_head_dtype)",
    )
    machine = parser.add_argument_group("machine")
    machine.add_argument("--device", default="cuda")
    machine.add_argument(
        "--peak-tflops", type=float, default=None, help="dense bf16 peak of the GPU (default: from its name)"
    )
    machine.add_argument(
        "--peak-gbps", type=float, default=None, help="memory bandwidth of the GPU (default: from its name)"
    )
    machine.add_argument(
        "--peak-fp32-tflops",
        type=float,
        default=None,
        help="dense fp32 (non-tensor-core) peak of the GPU (default: from its name)",
    )
    machine.add_argument("--json", default="", help="also write the results to this file")
    machine.add_argument(
        "--profile",
        default="",
        help="after timing, profile one more round of each phase (top operators, device-busy "
        "fraction, Chrome traces into this folder)",
    )
    return parser.parse_args()


# Datasheet peaks (dense bf16 TFLOP/s, memory GB/s, fp32 TFLOP/s) by a GPU name's marker;
# the first marker found in the name wins, and anything unknown falls back to the H100 SXM's.
PEAKS = {
    "H200": (989.0, 4800.0, 67.0),
    "H100 PCIe": (756.0, 2000.0, 51.0),
    "H100": (989.0, 3350.0, 67.0),
    "A100": (312.0, 2039.0, 19.5),
}


def fill_peaks(args: argparse.Namespace, device: torch.device) -> None:
    """Fill the peaks the user left out from the GPU's name (the H100 SXM's when unknown)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    marker = next((m for m in PEAKS if m in name), "H100")
    bf16, gbps, fp32 = PEAKS[marker]
    args.peak_tflops = args.peak_tflops or bf16
    args.peak_gbps = args.peak_gbps or gbps
    args.peak_fp32_tflops = args.peak_fp32_tflops or fp32
    print(
        f"peaks ({marker if marker in name else 'H100 SXM, assumed'}): bf16 {args.peak_tflops:g} TFLOP/s, "
        f"memory {args.peak_gbps:g} GB/s, fp32 {args.peak_fp32_tflops:g} TFLOP/s"
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def attention_flops_per_token(args: argparse.Namespace, context: float) -> float:
    """Forward FLOPs of the attention products (scores and weighted sum) for one token at ``context`` keys."""
    return 4.0 * args.layers * args.hidden * context


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    """Bytes of keys and values one cached token holds across layers (bf16)."""
    return 2 * args.layers * args.kv_heads * (args.hidden // args.heads) * 2


def build_model(args: argparse.Namespace, tokenizer) -> torch.nn.Module:
    shape = TinyModelConfig(
        family="qwen2",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=args.prompt_tokens + args.new_tokens + 16,
        tie_word_embeddings=True,
    )
    return build_tiny_model(
        shape, args.vocab, tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    )


def generate(args, engine: NativeRolloutEngine, prompts: list[tuple[int, ...]], tag: str):
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True)
    requests = [RolloutRequest(f"{tag}-{i}", prompt, params) for i, prompt in enumerate(prompts)]
    return engine.generate_batch(requests, timeout=3600)


def measure_generation(args, model, tokenizer, device, prompts) -> tuple[dict, list]:
    config = NativeEngineConfig(
        max_num_seqs=len(prompts),
        max_model_len=args.prompt_tokens + args.new_tokens,
        max_prefill_tokens=len(prompts) * args.prompt_tokens,
        dtype="bfloat16" if device.type == "cuda" else "float32",
        device=str(device),
        prefix_cache_entries=0,
    )
    engine = NativeRolloutEngine(model, tokenizer, config)
    try:
        for round_ in range(args.warmup):
            generate(args, engine, prompts, f"warm{round_}")
        reset_peak(device)
        synchronize(device)
        start = time.perf_counter()
        completions = generate(args, engine, prompts, "timed")
        synchronize(device)
        seconds = time.perf_counter() - start
        memory = peak_memory_gb(device)
        profiled = (
            profile_phase(lambda: generate(args, engine, prompts, "profiled"), device, "gen", args.profile)
            if args.profile
            else {}
        )
    finally:
        engine.close()
    params = sum(p.numel() for p in model.parameters())
    batch, new, prompt_len = len(prompts), args.new_tokens, args.prompt_tokens
    tokens = batch * new
    weight_bytes = params * (2 if device.type == "cuda" else 4)
    # Decode step t reads the weights once and batch * (prompt_len + t) cached tokens.
    kv_read = sum(batch * (prompt_len + t) * kv_bytes_per_token(args) for t in range(new))
    flops = 2.0 * params * (tokens + batch * prompt_len) + sum(
        batch * attention_flops_per_token(args, prompt_len + t) for t in range(new)
    )
    return {
        "gen_seconds": seconds,
        "gen_tokens_per_s": tokens / seconds,
        "gen_bandwidth_gbps": (weight_bytes * new + kv_read) / seconds / 1e9,
        "gen_bandwidth_fraction": (weight_bytes * new + kv_read) / seconds / 1e9 / args.peak_gbps,
        "gen_mfu": flops / seconds / (args.peak_tflops * 1e12),
        "gen_peak_memory_gb": memory,
        **profiled,
    }, completions


def measure_update(args, model, device, prompts, completions, pad_id: int) -> dict:
    engine = TorchTrainEngine(
        EngineConfig(
            device=str(device),
            mixed_precision="bf16" if device.type == "cuda" else "none",
            max_tokens_per_micro_batch=args.micro_batch_tokens,
            logprob_head_dtype=args.head_dtype,
            lr=1e-6,
        ),
        model=model,
    )
    engine.initialize()
    tensors = sequence_tensors(prompts, completions, pad_id)
    generator = torch.Generator().manual_seed(0)
    tensors["advantages"] = torch.randn(tensors["response_mask"].shape, generator=generator)
    batch = Batch(tensors)
    mask = batch["response_mask"]
    loss_fn = make_actor_loss(PolicyLossConfig(), LossNormalizer.from_mask(mask), old_from_current=True)

    ROUTES.clear()

    def update() -> None:
        engine.forward_backward(batch, loss_fn)
        engine.optimizer_step()

    for _ in range(args.warmup):
        update()
    reset_peak(device)
    synchronize(device)
    start = time.perf_counter()
    update()
    synchronize(device)
    seconds = time.perf_counter() - start
    update_peak = peak_memory_gb(device)
    profiled = profile_phase(update, device, "update", args.profile) if args.profile else {}
    offload = measure_offload(engine, device)
    params = sum(p.numel() for p in model.parameters())
    tokens = int(batch["attention_mask"].sum())
    lengths = batch["attention_mask"].sum(-1).float()
    # Causal attention: a sequence of L tokens does ~L^2/2 query-key pairs; backward is twice forward.
    attention = 3.0 * float((lengths * lengths / 2).sum()) * 4.0 * args.layers * args.hidden
    flops = 6.0 * params * tokens + attention
    # The fp32 head (log-probs): forward, its recompute in backward, and two backward products,
    # each 2 x tokens x hidden x vocab, on the fp32 units. The rest at the bf16 peak at best.
    head_fp32 = 8.0 * tokens * args.hidden * args.vocab
    fastest = head_fp32 / (args.peak_fp32_tflops * 1e12) + (flops - 6.0 * tokens * args.hidden * args.vocab) / (
        args.peak_tflops * 1e12
    )
    bound = {}
    if args.head_dtype == "float32":
        bound["update_mfu_bound_fp32_head"] = flops / fastest / (args.peak_tflops * 1e12)
    return {
        "update_seconds": seconds,
        "update_tokens_per_s": tokens / seconds,
        "update_mfu": flops / seconds / (args.peak_tflops * 1e12),
        **bound,
        "update_attention_calls": dict(ROUTES),
        "update_peak_memory_gb": update_peak,
        **profiled,
        **offload,
    }


def measure_offload(engine: TorchTrainEngine, device: torch.device) -> dict:
    """Seconds to move the engine's parameters and optimizer state to host memory and back, and
    the GPU memory the move freed (0 on the CPU)."""
    engine.zero_grad()
    synchronize(device)
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    engine.offload()
    synchronize(device)
    offload_seconds = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.empty_cache()
    freed = resident - (torch.cuda.memory_allocated(device) if device.type == "cuda" else 0)
    start = time.perf_counter()
    engine.reload()
    synchronize(device)
    return {
        "offload_seconds": offload_seconds,
        "reload_seconds": time.perf_counter() - start,
        "offload_freed_gb": freed / 1e9,
    }


def main() -> None:
    args = parse_args()
    device = bind_device(args.device)  # "cuda" resolves to an indexed device, made current
    print(
        f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, device {device}"
    )
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}")
    fill_peaks(args, device)
    tokenizer = build_char_tokenizer()
    model = build_model(args, tokenizer)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {params / 1e6:.0f}M parameters ({args.layers} layers, hidden {args.hidden}, vocab {args.vocab})"
    )
    generator = torch.Generator().manual_seed(1)
    unique = [
        tuple(torch.randint(6, args.vocab, (args.prompt_tokens,), generator=generator).tolist())
        for _ in range(args.prompts)
    ]
    prompts = [prompt for prompt in unique for _ in range(args.n)]
    kernel = installed_varlen_kernel() if device.type == "cuda" else None
    results = {
        "device": str(device),
        "params": params,
        "decode_batch": len(prompts),
        "varlen_kernel_installed": kernel.provider if kernel else "none",
    }
    report(results, results, args.json)
    generation, completions = measure_generation(args, model, tokenizer, device, prompts)
    report(generation, results, args.json)
    del model  # the rollout's bf16 copy; the trainer loads its own fp32 master weights
    trainer_model = build_model(args, tokenizer)
    update = measure_update(args, trainer_model, device, prompts, completions, tokenizer.pad_token_id)
    report(update, results, args.json)


def report(new: dict, results: dict, json_path: str | None) -> None:
    """Print ``new`` figures and rewrite the JSON with everything so far, phase by phase: a run
    stopped by its time limit (a device call's) keeps the phases it measured."""
    results.update(new)
    for name, value in new.items():
        print(f"{name}: {value:.4g}" if isinstance(value, float) else f"{name}: {value}", flush=True)
    if json_path:
        with open(json_path, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
