"""Data parallelism for the engine: DDP or FSDP2 ``fully_shard`` over the default process group
(or, under tensor parallelism, over the mesh's flattened ``dp_sp`` dimension).

Without tensor parallelism the default group is the whole ``(dp, sp)`` mesh
(:mod:`tandem.engine.mesh`): with sequence
parallelism each rank's gradient covers its shard of the tokens only, so gradients are
reduced over the sequence-parallel ranks as well as the data-parallel ones, and FSDP2 shards
parameters over all of them (as verl does).

FSDP2 is applied bottom-up: each decoder layer (and a vision-language model's vision block) is
its own shard unit, then the root (embeddings, final norm, output head, a vision tower's patch
embedding and merger, LoRA adapters) — the order FSDP2 expects so each layer's parameters
are gathered just before it runs and freed after. It runs on CPU with gloo and on GPU with NCCL.
With ``mixed_precision="bf16"`` FSDP2 gathers parameters in bf16 for compute and reduces
gradients in fp32 into fp32 shards, which the optimizer updates (the master weights).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from tandem.engine.vision_model import vision_blocks


def rank_strategy(configured: str, world_size: int, tp_size: int = 1) -> str:
    """The strategy a worker of a group of ``world_size`` runs: ``single`` alone (DDP or FSDP2
    over one rank is the single process), DDP when ``single`` was asked of several ranks, unless
    they are one tensor-parallel group of ``tp_size`` ranks (which ``single`` trains)."""
    if world_size == 1:
        return "single"
    if configured == "single" and world_size == tp_size:
        return "single"
    return "ddp" if configured == "single" else configured


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of an HF decoder (``model.layers``), found by name."""
    layers = []
    for name, child in module.named_modules():
        if name.endswith(".layers") and isinstance(child, nn.ModuleList):
            layers.extend(child)
    return layers


def wrap_data_parallel(
    module: nn.Module,
    strategy: str,
    device: torch.device,
    mixed_precision: str = "none",
    dp_mesh: DeviceMesh | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """``module`` as it should be called: itself, a DDP wrapper, or sharded in place by FSDP2.

    ``module`` is on ``device`` for DDP (told its GPU) and may still be on the CPU for FSDP2,
    which moves each unit to ``device`` as it shards it, with its mixed-precision policy.
    FSDP2 shards over ``dp_mesh`` (the ``dp_sp`` dimension under tensor parallelism, whose
    DTensor shards it shards again), by default over every rank. ``ignored_params`` (expert
    shards, reduced by their own group: :mod:`tandem.engine.expert_parallel`) are neither
    broadcast, reduced nor sharded.
    """
    if strategy == "single":
        return module
    if strategy == "ddp":
        if ignored_params:
            ignored = [name for name, param in module.named_parameters() if param in ignored_params]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored)
        return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers = decoder_layers(module) + vision_blocks(module)  # a VLM's vision blocks are units too
    if not layers:
        raise ValueError("FSDP2 found no decoder layers (a ModuleList named 'layers') to shard")
    policy = MixedPrecisionPolicy()
    if mixed_precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # the engine's device type, not the machine's: a CPU engine on a GPU host shards on the CPU
    mesh = dp_mesh if dp_mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, ignored_params=ignored_params or None)
    fully_shard(module, mesh=mesh, mp_policy=policy, ignored_params=ignored_params or None)
    return module


def reshard(module: nn.Module) -> None:
    """Free the full parameters FSDP2 gathered and leave ``module`` holding its shards again.

    FSDP2 reshards the root unit (embeddings, final norm, head) after a backward, not after a
    forward: after a forward-only pass the root's parameters are full copies (in the compute
    dtype under bf16), which an offload, a weight sync or an export would otherwise read.
    Nothing happens to a module that is not sharded, or already is.
    """
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
