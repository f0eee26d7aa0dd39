"""Data parallelism for the engine: DDP or FSDP2 ``fully_shard`` over the default process group.

FSDP2 is applied bottom-up: each decoder layer is its own shard unit, then the root (embeddings,
final norm, output head, LoRA adapters) — the order FSDP2 expects so each layer's parameters
are gathered just before it runs and freed after. It runs on CPU with gloo and on GPU with NCCL.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def data_parallel_size(strategy: str) -> int:
    return dist.get_world_size() if strategy != "single" else 1


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of an HF decoder (``model.layers``), found by name."""
    layers = []
    for name, child in module.named_modules():
        if name.endswith(".layers") and isinstance(child, nn.ModuleList):
            layers.extend(child)
    return layers


def wrap_data_parallel(module: nn.Module, strategy: str) -> nn.Module:
    """``module`` as it should be called: itself, a DDP wrapper, or sharded in place by FSDP2."""
    if strategy == "single":
        return module
    if strategy == "ddp":
        return DistributedDataParallel(module)
    from torch.distributed.fsdp import fully_shard

    layers = decoder_layers(module)
    if not layers:
        raise ValueError("FSDP2 found no decoder layers (a ModuleList named 'layers') to shard")
    for layer in layers:
        fully_shard(layer)
    fully_shard(module)
    return module
