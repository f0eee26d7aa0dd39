"""Peak memory per phase of one sync GRPO step on SmolLM2-135M-Instruct, as multiples of its fp32 weights.

One GRPO step as ``tandem train preset=grpo`` runs it (local backend, one worker: the worker is
this process): 8 chat-templated arithmetic prompts x 4 responses, <= 32 new tokens, fp32, the
native rollout engine colocated with the actor; with the reference and the k3 KL loss (the
preset) and once without (``algorithm.kl.use_kl_loss=false``). Each variant runs in a fresh
process of its own (a process's resident set only remembers its own history), for ``--steps``
steps; the largest peak of each phase over the steps is reported.

How the peaks are measured: the process's resident high-water mark (``VmHWM`` of
``/proc/self/status``) is reset at every phase boundary (writing ``5`` to
``/proc/self/clear_refs``) and read at the next one, so each phase's figure is the largest
resident set the process reached inside it. The phases: ``gen`` (rollout), ``old_log_prob``,
``ref``, and the actor update split into ``update.forward`` (forward passes, loss included),
``update.backward`` and ``update.optimizer`` (clip + AdamW step) — the worker's own phase
brackets (``ActorRolloutRefWorker._phase``), with the split inside the update found by wrapping
``Tensor.backward`` and ``TorchTrainEngine.optimizer_step`` in this process only.

What holds the memory (measured from the objects at the last optimizer step, each storage counted once):
the actor's weights, its gradients and AdamW's two moments; the reference's weights; the
rollout engine's weights (those it shares with the actor count as shared) and its prepacked
oneDNN copies; its KV cache; the bytes autograd saved for backward in the update's largest
micro-batch (activations, tracked with ``saved_tensors_hooks``); one chunk of the fp32 head's
logits (``rows x vocabulary x 4`` bytes);
and ``runtime``: the resident set after imports, before any model was loaded (Python, torch,
transformers). The head chunk is the rows the head actually takes (``logprob_chunk_size``
capped by :func:`tandem.models.logprobs.chunk_rows`). The KV cache is capped for the bench (``rollout.engine.native.max_num_seqs=32``;
its length is the run's ``max_prompt_length + max_response_length``): unset, the native engine
sizes it from half the free memory, which measures the machine, not the step.

    python bench/real_model_memory.py [--steps 2] [--variants kl,no_kl] [--override KEY=VALUE ...] [--malloc-trim]

``--override`` passes more train-config overrides to every variant (e.g. to compare a setting).
``--malloc-trim`` calls glibc's ``malloc_trim(0)`` at every phase boundary (the blocks
``tandem.kernels.cpu.allocator`` lets the process keep go back to the kernel), to measure
what the retained blocks add to each phase's peak.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

PROMPTS, RESPONSES, NEW_TOKENS, PROMPT_LENGTH, KV_SLOTS = 8, 4, 32, 96, 32
VARIANTS = {"kl": [], "no_kl": ["algorithm.kl.use_kl_loss=false"]}
PHASES = (
    "setup",
    "gen",
    "old_log_prob",
    "ref",
    "update.forward",
    "update.backward",
    "update.optimizer",
    "other",
)
REWARD_SOURCE = (
    "def compute_score(data_source, solution, ground_truth, extra_info):\n"
    "    return float(solution.strip().endswith(str(ground_truth)))\n"
)


# ---------------------------------------------------------------------------------------- measuring
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def resident_bytes() -> int:
    return _status_kb("VmRSS") * 1024


class PeakMeter:
    """The resident high-water mark of each phase: reset at every switch, read at the next;
    ``malloc_trim``: glibc hands its free pages back to the kernel at every switch first."""

    def __init__(self, malloc_trim: bool = False) -> None:
        self.label = "setup"
        self.peaks: dict[str, int] = defaultdict(int)
        self.trim = ctypes.CDLL(None).malloc_trim if malloc_trim else None
        Path("/proc/self/clear_refs").write_text("5")  # fails loudly where the kernel refuses

    def switch(self, label: str) -> None:
        self.peaks[self.label] = max(self.peaks[self.label], _status_kb("VmHWM") * 1024)
        if self.trim is not None:
            self.trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.label = label


class SavedBytes:
    """The bytes of the distinct storages autograd saves for backward inside the block, but for
    ``excluded`` ones (the model's weights, which a linear layer saves too)."""

    def __init__(self, excluded: dict[int, int]) -> None:
        self.excluded = excluded
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        with contextlib.suppress(RuntimeError):  # a tensor without storage of its own
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.excluded:
                self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def instrument(meter: PeakMeter, seen: dict) -> None:
    """Put the meter's switches at the worker's phase brackets and inside the update (this process only)."""
    from tandem.engine import TorchTrainEngine
    from tandem.rl.worker import ActorRolloutRefWorker

    @contextlib.contextmanager
    def phase(worker, name: str):
        seen["worker"] = worker
        meter.switch("update.forward" if name == "update_actor" else name)
        try:
            yield
        finally:
            meter.switch("other")

    backward = torch.Tensor.backward

    def metered_backward(tensor, *args, **kwargs):
        inside_update = meter.label.startswith("update.")
        if inside_update:
            meter.switch("update.backward")
        backward(tensor, *args, **kwargs)
        if inside_update:
            meter.switch("update.forward")

    optimizer_step = TorchTrainEngine.optimizer_step

    def metered_optimizer_step(engine, *args, **kwargs):
        meter.switch("update.optimizer")
        seen["holders"] = holders(seen["worker"])  # as the update holds them (the last step's: Adam's too)
        try:
            return optimizer_step(engine, *args, **kwargs)
        finally:
            meter.switch("update.forward")

    forward = TorchTrainEngine._forward

    def metered_forward(engine, *args, **kwargs):
        if not (meter.label.startswith("update.") and torch.is_grad_enabled()):
            return forward(engine, *args, **kwargs)
        saved = SavedBytes(_storages(engine.causal_lm.parameters()))
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
            outputs = forward(engine, *args, **kwargs)
        seen["activations"] = max(seen.get("activations", 0), saved.total)
        return outputs

    ActorRolloutRefWorker._phase = phase
    torch.Tensor.backward = metered_backward
    TorchTrainEngine.optimizer_step = metered_optimizer_step
    TorchTrainEngine._forward = metered_forward


# ---------------------------------------------------------------------------------------- accounting
def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _storages(tensors) -> dict[int, int]:
    """``{storage pointer: bytes}`` of plain tensors (mkldnn-packed ones by their element count)."""
    out = {}
    for tensor in tensors:
        if tensor is None:
            continue
        try:
            out[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # an opaque (mkldnn) tensor: no storage to name
            out[id(tensor)] = _nbytes(tensor)
    return out


def holders(worker) -> dict[str, int]:
    """What the worker's objects hold, in bytes (each storage once; see the module docstring)."""
    actor = worker.engine.causal_lm
    actor_weights = _storages(actor.parameters())
    grads = sum(_nbytes(p) for p in actor.parameters() if p.requires_grad)  # alive through the optimizer step
    adam = sum(
        _nbytes(value)
        for state in worker.engine.optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )
    out = {"actor weights": sum(actor_weights.values()), "actor grads": grads, "Adam moments": adam}
    if worker.reference is not None:
        ref = _storages(worker.reference.causal_lm.parameters())
        out["reference weights"] = sum(v for k, v in ref.items() if k not in actor_weights)
    rollout = worker.rollout
    if rollout is not None and hasattr(rollout, "_packed"):  # the native engine
        own = _storages(rollout.model.parameters())
        out["rollout weights (own copy)"] = sum(v for k, v in own.items() if k not in actor_weights)
        packed = rollout._packed
        out["rollout prepacked weights"] = sum(_nbytes(t) for t in packed._packed.values()) + sum(
            _nbytes(weight) for weight, _ in packed._fused.values()
        )
        out["rollout KV cache"] = rollout.cache.nbytes
    return out


# ---------------------------------------------------------------------------------------- one variant
def child(root: Path, variant: str, steps: int, overrides: list[str], malloc_trim: bool) -> None:
    runtime = resident_bytes()
    meter = PeakMeter(malloc_trim)
    seen: dict = {}
    instrument(meter, seen)
    from tandem.models.logprobs import chunk_rows
    from tandem.rl import RLTrainer, load_train_config

    config = load_train_config(
        [
            "preset=grpo",
            f"model_path={root / 'model'}",
            f"data.train_path={root / 'prompts.parquet'}",
            f"data.train_batch_size={PROMPTS}",
            f"data.max_prompt_length={PROMPT_LENGTH}",
            f"rollout.n={RESPONSES}",
            f"rollout.max_response_length={NEW_TOKENS}",
            f"rollout.engine.native.max_num_seqs={KV_SLOTS}",
            "actor.engine.lr=1e-6",
            f"reward.custom_path={root / 'reward.py'}",
            f"trainer.total_steps={steps}",
            "trainer.loggers=[]",
            "trainer.report=false",
            "trainer.export_hf=false",
            "trainer.resume=disable",
            f"trainer.output_dir={root / variant}",
            *VARIANTS[variant],
            *overrides,
        ]
    )
    trainer = RLTrainer(config)
    history = trainer.fit().history
    meter.switch("other")
    worker = seen["worker"]
    engine_config = worker.engine.config
    vocab = worker.engine.causal_lm.get_output_embeddings().weight.shape[0]
    result = {
        "variant": variant,
        "params": sum(p.numel() for p in worker.engine.causal_lm.parameters()),
        "peaks": dict(meter.peaks),
        "holders": {
            "runtime (after imports)": runtime,
            **seen["holders"],
            "update activations (largest micro-batch)": seen.get("activations", 0),
            "one head chunk of logits": chunk_rows(engine_config.logprob_chunk_size, vocab) * vocab * 4,
        },
        "tokens": [h.get("response_length/mean", 0.0) for h in history],
    }
    print("RESULT " + json.dumps(result))


# ---------------------------------------------------------------------------------------- the table
def print_result(result: dict) -> None:
    weights = result["params"] * 4
    gib = 2**30
    print(
        f"\n== {result['variant']}: {result['params'] / 1e6:.1f}M parameters, fp32 weights {weights / gib:.3f} GiB"
    )
    print(f"{'phase':<22}{'peak RSS bytes':>16}{'GiB':>8}{'x weights':>11}")
    for phase in PHASES:
        if phase in result["peaks"]:
            peak = result["peaks"][phase]
            print(f"{phase:<22}{peak:>16,}{peak / gib:>8.3f}{peak / weights:>11.2f}")
    step_peak = max(v for k, v in result["peaks"].items() if k != "setup")
    print(f"{'step (max)':<22}{step_peak:>16,}{step_peak / gib:>8.3f}{step_peak / weights:>11.2f}")
    print(f"{'holder':<42}{'bytes':>16}{'x weights':>11}")
    for name, size in result["holders"].items():
        print(f"{name:<42}{size:>16,}{size / weights:>11.2f}")
    counted = sum(result["holders"].values())
    print(f"{'sum of holders':<42}{counted:>16,}{counted / weights:>11.2f}")
    print(
        f"{'step peak - sum (allocator, transients)':<42}{step_peak - counted:>16,}{(step_peak - counted) / weights:>11.2f}"
    )


def prepare(root: Path) -> None:
    """The converted model (linked), chat-templated arithmetic prompts and the reward function under ``root``."""
    from tandem.data import write_parquet
    from tandem.models.gguf import resolve_model_path
    from tandem.models.packaged import SMOLLM2_INSTALL_HINT, smollm2_gguf_path
    from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows

    gguf = smollm2_gguf_path()
    if gguf is None:
        raise SystemExit(f"this benchmark needs SmolLM2: {SMOLLM2_INSTALL_HINT}")
    (root / "model").symlink_to(resolve_model_path(str(gguf)))
    write_parquet(arithmetic_rows(64, ArithmeticTaskConfig(max_digits=2), seed=0), root / "prompts.parquet")
    (root / "reward.py").write_text(REWARD_SOURCE)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--variants", default="kl,no_kl")
    parser.add_argument("--override", action="append", default=[], help="one more train-config override")
    parser.add_argument(
        "--malloc-trim", action="store_true", help="glibc's malloc_trim(0) at every phase boundary"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.root, args.child, args.steps, args.override, args.malloc_trim)
        return
    print(describe_machine())
    print(f"load: {os.getloadavg()[0]:.2f} (1-minute average)")
    print(
        f"one sync GRPO step: {PROMPTS} prompts x {RESPONSES} responses, <= {NEW_TOKENS} new tokens, fp32, "
        f"native rollout colocated, KV cache capped at {KV_SLOTS} slots; overrides {args.override or 'none'}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare(root)
        for variant in args.variants.split(","):
            extra = [f"--override={o}" for o in args.override]
            command = [
                sys.executable,
                __file__,
                "--child",
                variant,
                "--root",
                str(root),
                "--steps",
                str(args.steps),
                *extra,
                *(["--malloc-trim"] if args.malloc_trim else []),
            ]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                raise SystemExit(f"variant {variant} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            print_result(json.loads(lines[-1][len("RESULT ") :]))


if __name__ == "__main__":
    main()
