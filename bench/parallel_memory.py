"""Memory per rank of one actor update at sequence- and tensor-parallel sizes 1 and 2, as ratios against one rank.

Each configuration runs in fresh gloo processes (``world = dp * sp * tp``; FSDP2 across them when
there are several): one forward/backward of a policy-gradient-style loss over one long packed
row, then an optimizer step. Two figures per rank:

* **activations**: the bytes autograd saved for backward during the forward (tracked through
  ``torch.autograd.graph.saved_tensors_hooks``, each storage counted once); on CUDA also the
  allocator's peak during the step (``max_memory_allocated``) less what was allocated before it.
* **parameters + gradients + optimizer state**: the bytes of this rank's shards of each, after
  the step (a DTensor counts its local shard).

Expected: activations per rank ~1/sp (each rank holds its shard of the tokens; attention's
all-to-all output is the one full-length tensor per layer, split over heads instead), and
parameter+optimizer bytes ~1/world under FSDP2; under tensor parallelism (``tp=2``, FSDP2 over
``dp=1``) parameter+optimizer bytes ~1/tp (the norms stay whole on every rank) and activations
fall for the split projections only (the residual stream and norms are whole on every rank).
The ``dp=2`` layout gives each rank the same row (data parallelism splits rows, never a
sequence), to show what sharding the parameters alone saves. Run: ``python bench/parallel_memory.py [--tokens 4096] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

from tandem.engine import EngineConfig, TokenOutputs, TorchTrainEngine  # noqa: E402
from tandem.models import TinyModelConfig, save_tiny_model  # noqa: E402
from tandem.protocol import Batch  # noqa: E402

BENCH_MODEL = TinyModelConfig(
    family="qwen2", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=768
)


def one_row(tokens: int, sequences: int = 1) -> Batch:
    """``sequences`` responses of ``tokens / sequences`` tokens each, random ids: one packed row
    (one long sequence by default: what data parallelism cannot split)."""
    gen = torch.Generator().manual_seed(0)
    length = tokens // sequences
    ids = torch.randint(6, 60, (sequences, length), generator=gen)
    mask = torch.ones_like(ids)
    return Batch({"input_ids": ids, "attention_mask": mask, "loss_mask": mask})


def mean_log_prob_loss(micro: Batch, outputs: TokenOutputs) -> tuple[torch.Tensor, dict]:
    mask = micro["loss_mask"].float()
    return -(outputs.log_probs * mask).sum() / mask.sum(), {}


class SavedBytes:
    """The bytes of the distinct storages autograd saves for backward inside the block."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        local = tensor
        if isinstance(tensor, DTensor):  # a wrapper (tensor parallelism): its local shard holds the bytes
            with torch.no_grad():
                local = tensor.to_local()
        try:
            storage = local.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # a wrapper subclass without storage of its own (a collective's pending result)
            self.storages[id(local)] = local.numel() * local.element_size()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def state_bytes(engine: TorchTrainEngine) -> int:
    """This rank's parameters, gradients and optimizer state, in bytes (local shards)."""
    params = list(engine.causal_lm.parameters())
    total = sum(_local_bytes(p) + _local_bytes(p.grad) for p in params)
    for state in engine.optimizer.state.values():
        total += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def measure(
    rank: int, world: int, sp: int, tp: int, model_dir: str, tokens: int, device: str, port: int, out
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    warnings.filterwarnings(
        "ignore", message="FSDP2-wrapped module"
    )  # once per forward; not ours to fix here
    if device == "cuda":
        torch.cuda.set_device(rank)
    if world > 1:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    engine = TorchTrainEngine(
        EngineConfig(
            model_path=model_dir, device=device, strategy="fsdp2" if world > 1 else "single", sp_size=sp, tp_size=tp,
            max_tokens_per_micro_batch=tokens, pad_tokens_to_multiple=1, lr=1e-4,
        )
    )  # fmt: skip
    engine.initialize()
    batch = one_row(tokens)
    saved = SavedBytes()
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
        engine.forward_backward(batch, mean_log_prob_loss)
    engine.optimizer_step()
    peak = torch.cuda.max_memory_allocated() - before if device == "cuda" else 0
    out.put((rank, saved.total, state_bytes(engine), peak))
    if world > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(world: int, sp: int, tp: int, model_dir: str, tokens: int, device: str) -> tuple[float, float, float]:
    """Mean over ranks of (saved activation bytes, state bytes, CUDA peak bytes)."""
    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=measure, args=(rank, world, sp, tp, model_dir, tokens, device, port, out))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    return tuple(sum(r[i] for r in results) / len(results) for i in (1, 2, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    print(describe_machine())
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(save_tiny_model(Path(tmp) / "model", BENCH_MODEL))
        layouts = {"dp=1": (1, 1, 1), "dp=1 sp=2": (2, 2, 1), "dp=1 tp=2": (2, 1, 2), "dp=2": (2, 1, 1)}
        figures = {}
        for name, (world, sp, tp) in layouts.items():
            figures[name] = run(world, sp, tp, model_dir, args.tokens, args.device)
    base_act, base_state, base_peak = figures["dp=1"]
    print(
        f"one packed row of {args.tokens} tokens, {BENCH_MODEL.num_layers} layers, hidden {BENCH_MODEL.hidden_size}"
    )
    print(f"{'layout':12s} {'activations/rank':>18s} {'ratio':>7s} {'params+grads+optim/rank':>24s} {'ratio':>7s}"
          + (f" {'CUDA peak/rank':>15s} {'ratio':>7s}" if args.device == "cuda" else ""))  # fmt: skip
    for name, (act, state, peak) in figures.items():
        line = f"{name:12s} {act / 2**20:15.1f} MiB {act / base_act:7.2f} {state / 2**20:21.1f} MiB {state / base_state:7.2f}"
        if args.device == "cuda":
            line += f" {peak / 2**20:12.1f} MiB {peak / base_peak:7.2f}"
        print(line)


if __name__ == "__main__":
    main()
