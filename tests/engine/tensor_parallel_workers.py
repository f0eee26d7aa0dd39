"""A worker holding a training engine on a ``(dp, tp)`` mesh (the tensor-parallelism tests' processes)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from tandem.checkpoint_engine.buckets import group_tensors
from tandem.controller import register
from tandem.engine.vocab_parallel import vocab_parallel_softmax_outputs, vocab_range
from tandem.models import build_char_tokenizer
from tests.engine.ulysses_workers import UlyssesWorker


class TensorParallelWorker(UlyssesWorker):
    """:class:`UlyssesWorker` with checkpoints, export, weight buckets and the vocabulary-parallel
    softmax on a rank's shard."""

    @register(dispatch="ONE_TO_ALL")
    def save(self, path: str) -> None:
        self.engine.save(path)

    @register(dispatch="ONE_TO_ALL")
    def load(self, path: str) -> None:
        self.engine.load(path)

    @register(dispatch="ONE_TO_ALL")
    def export(self, path: str) -> None:
        self.engine.export_hf(path, build_char_tokenizer(), write=self.rank == 0)

    @register(dispatch="ONE_TO_ALL")
    def weight_buckets(self, limit: int) -> dict:
        """The weights as a weight sync sends them (buckets of at most ``limit`` bytes): every
        tensor, and the most bytes of gathered weights held at once."""
        tensors, largest = {}, 0
        for bucket in group_tensors(self.engine.iter_parameters(), limit):
            largest = max(largest, sum(t.numel() * t.element_size() for _, t in bucket))
            tensors |= {name: tensor.cpu().clone() for name, tensor in bucket}
        return {"tensors": tensors, "largest_bucket": largest}

    @register(dispatch="ONE_TO_ALL")
    def gradient_mesh(self) -> tuple[list[int] | None, list[str]]:
        """The ranks of the engine's FSDP2 mesh (``EngineMesh.dp_mesh``; None without tensor
        parallelism), and the messages of the warnings reading it raised."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mesh = self.engine.mesh.dp_mesh
        return (None if mesh is None else mesh.mesh.tolist()), [str(warning.message) for warning in caught]

    @register(dispatch="ONE_TO_ALL")
    def vocab_parallel(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The vocabulary-parallel softmax of this rank's shard of ``logits [N, V]`` at
        ``labels [N]``: its outputs, and the gradient a backward of
        ``sum(log_probs * up_log_probs + entropy * up_entropy)`` leaves on the shard."""
        logits = inputs["logits"]
        start, end = vocab_range(logits.shape[-1], self.world_size, self.rank)
        shard = logits[:, start:end].clone().requires_grad_()
        log_probs, entropy, sum_pi_squared = vocab_parallel_softmax_outputs(
            shard, inputs["labels"], True, start, dist.group.WORLD
        )
        ((log_probs * inputs["up_log_probs"]).sum() + (entropy * inputs["up_entropy"]).sum()).backward()
        return {
            "log_probs": log_probs.detach(),
            "entropy": entropy.detach(),
            "sum_pi_squared": sum_pi_squared,
            "grad": shard.grad,
        }
