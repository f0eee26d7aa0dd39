"""One engine's side of bench/rollout_throughput.py, run in a process of its own.

    python bench/rollout_engines.py --engine native|hf|vllm --spec SPEC.json [--threads 2]

``SPEC.json`` (written by the parent): ``model`` (an HF directory), ``eos`` and ``pad`` token
ids, ``repeats``, and ``workloads``: ``[{"name", "prompts": [[ids]], "max_tokens",
"ignore_eos"}]`` (each prompt listed once per sample). Prints one JSON line: per workload the
generated tokens/s of each timed run and the response lengths, after one short warm-up run,
prefixed with ``RESULT_MARK`` (vLLM also logs to stdout, before and after it).

Imports no tandem at module level: the vLLM side runs in vLLM's own environment (its own
torch), which needs only ``transformers`` and ``vllm``. Sampling is the same everywhere:
temperature 1, no top-k/top-p, fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def native_runner(path: str, spec: dict):
    """tandem's native engine: ``run(prompts, max_tokens, ignore_eos) -> lengths``."""
    from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, RolloutRequest, SamplingParams

    longest = max(len(p) for w in spec["workloads"] for p in w["prompts"])
    most = max(w["max_tokens"] for w in spec["workloads"])
    engine = NativeRolloutEngine.from_pretrained(
        path, NativeEngineConfig(max_num_seqs=256, max_model_len=longest + most + 8)
    )
    calls = iter(range(1_000_000))

    def run(prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> list[int]:
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        call = next(calls)
        requests = [RolloutRequest(f"{call}-{i}", tuple(p), params) for i, p in enumerate(prompts)]
        return [len(c.token_ids) for c in engine.generate_batch(requests, timeout=3600)]

    return run


def hf_runner(path: str, spec: dict):
    """HF ``generate`` on one static left-padded batch (the path TRL uses on CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos, pad = spec["eos"], spec["pad"]

    @torch.inference_mode()
    def run(prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> list[int]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        out = model.generate(
            ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=max_tokens, min_new_tokens=max_tokens if ignore_eos else 0,
            eos_token_id=eos, pad_token_id=pad,
        )  # fmt: skip
        generated = out[:, width:]
        if ignore_eos:
            return [generated.shape[1]] * len(prompts)
        ended = generated == eos
        full = torch.full((len(prompts),), generated.shape[1])
        return torch.where(ended.any(-1), ended.float().argmax(-1) + 1, full).tolist()

    return run


def vllm_kv_cache_bytes(path: str, spec: dict) -> int:
    """Bytes of an fp32 KV cache holding the largest workload's requests at full length (plus a
    quarter): vLLM's CPU worker otherwise reserves ``gpu_memory_utilization`` (0.92 by default)
    of the machine's RAM and refuses to start when less is free."""
    config = json.loads((Path(path) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_token = 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * 4
    longest = max(len(p) for w in spec["workloads"] for p in w["prompts"])
    most = max(w["max_tokens"] for w in spec["workloads"])
    rows = max(len(w["prompts"]) for w in spec["workloads"])
    return int(1.25 * rows * (longest + most + 8) * per_token) + (64 << 20)


def vllm_threads_env(threads: int) -> None:
    """Bind vLLM's model worker to ``threads`` of this process's CPUs: its default ("auto")
    keeps one core per worker for the engine-core process, i.e. 1 of a 2-core machine's 2."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cpus))


def vllm_runner(path: str, spec: dict):
    """vLLM (its CPU build on a CPU machine), fp32, eager; start-up not timed. Its KV cache is
    sized from the workloads (:func:`vllm_kv_cache_bytes`) and its worker gets ``--threads``
    cores (:func:`vllm_threads_env`)."""
    vllm_threads_env(spec["threads"])
    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(p) for w in spec["workloads"] for p in w["prompts"])
    most = max(w["max_tokens"] for w in spec["workloads"])
    llm = LLM(
        model=path, dtype="float32", enforce_eager=True, max_model_len=longest + most + 8, seed=0,
        kv_cache_memory_bytes=vllm_kv_cache_bytes(path, spec),
        max_num_seqs=256,  # as the native engine's
    )  # fmt: skip

    def run(prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> list[int]:
        params = VllmSamplingParams(
            temperature=1.0, top_k=-1, top_p=1.0, max_tokens=max_tokens, ignore_eos=ignore_eos
        )
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
        )
        return [len(o.outputs[0].token_ids) for o in outputs]

    return run


RESULT_MARK = "ROLLOUT-ENGINE-RESULT "  # the result line's prefix: vLLM logs to stdout too, also at exit
RUNNERS = {"native": native_runner, "hf": hf_runner, "vllm": vllm_runner}


def measure(run, spec: dict) -> dict:
    """Per workload: tokens/s of each of ``spec["repeats"]`` timed runs and all response lengths."""
    first = spec["workloads"][0]["prompts"]
    run(first[: min(8, len(first))], 8, True)  # warm-up
    results = {}
    for workload in spec["workloads"]:
        rates, lengths = [], []
        for _ in range(spec["repeats"]):
            start = time.perf_counter()
            done = run(workload["prompts"], workload["max_tokens"], workload["ignore_eos"])
            rates.append(sum(done) / (time.perf_counter() - start))
            lengths.extend(done)
        results[workload["name"]] = {"rates": rates, "lengths": lengths}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=sorted(RUNNERS), required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with open(args.spec) as f:
        spec = json.load(f)
    spec["threads"] = args.threads
    results = measure(RUNNERS[args.engine](spec["model"], spec), spec)
    results["torch"] = torch.__version__
    print(RESULT_MARK + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
