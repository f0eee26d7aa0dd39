"""Expert parallelism for Qwen2-MoE / Qwen3-MoE decoders: each MoE layer's experts split over ``ep`` ranks.

The layout is "experts within data parallelism": the ``ep`` ranks of a group are data-parallel
ranks, each with its own rows. The world of ``W`` ranks is the mesh ``(edp, ep) = (W / ep, ep)``,
rank ``d * ep + e`` (the ranks of an expert-parallel group are neighbours). Rank ``e`` of a
group holds experts ``e * E / ep .. (e + 1) * E / ep - 1`` of every MoE layer (DTensors sharded
on the expert dimension, replicated over ``edp``); in each MoE layer the tokens it routes are
sent to the experts' owners and back (:class:`~tandem.models.sharded_experts.ShardedExperts`).
Everything else (attention, norms, embeddings, the router, Qwen2-MoE's shared expert) stays
replicated and is reduced over every rank by DDP or FSDP2, which leave the expert shards alone.

Gradients: the engine multiplies each micro-batch's loss by the world size so that DDP's and
FSDP2's average becomes a sum. An expert shard's gradient is not averaged by them: in its
backward it is multiplied by ``1 / W`` and summed over the ``edp`` group (the ranks holding
the same experts for other groups' tokens), so it becomes the sum over every rank's tokens,
as a replicated weight's is. The gradient norm is reduced over the ``ep`` dimension
(:func:`tandem.engine.grad_norm.clip_grad_norm_`).

The shards are DTensors of the whole tensors' shapes, so checkpoints (DCP) reshard between any
``ep_size`` and exports and weight syncs gather one whole tensor at a time with
``full_tensor()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from tandem.engine.config import EngineConfig
from tandem.models.sharded_experts import EXPERT_WEIGHTS, ShardedExperts

EXPERT_BLOCKS = ("mlp",)  # where an HF MoE decoder layer keeps its sparse block (its ``experts``)


@dataclass(frozen=True)
class ExpertMesh:
    """This rank's place in the ``(edp, ep)`` mesh.

    Attributes:
        ep_size / ep_rank: the expert-parallel group's size and this rank's place in it.
        edp_size: how many groups hold the same experts (``world / ep_size``).
        device_mesh: ``(edp, ep)``, which the expert DTensors live on.
        dispatch_group: the expert-parallel group the tokens are exchanged in.
        reduce_group: the ranks holding this rank's experts (``None`` when ``edp_size`` is 1).
    """

    ep_size: int
    ep_rank: int
    edp_size: int
    device_mesh: DeviceMesh
    dispatch_group: ProcessGroup
    reduce_group: ProcessGroup | None


def build_expert_mesh(device_type: str, ep_size: int) -> ExpertMesh:
    """The ``(edp, ep)`` mesh of the default group's ranks (a collective: every rank calls it).

    The dispatch and reduce groups are groups of their own, never the default one, so their
    collectives (inside the backward) cannot interleave with DDP's or FSDP2's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_world_fits(ep_size, world)
    edp = world // ep_size
    mesh = init_device_mesh(device_type, (edp, ep_size), mesh_dim_names=("edp", "ep"))
    dispatch = reduce = None
    for start in range(0, world, ep_size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(start, start + ep_size)))
        if start <= rank < start + ep_size:
            dispatch = group
    if edp > 1:
        for shard in range(ep_size):
            group = dist.new_group(list(range(shard, world, ep_size)))
            if rank % ep_size == shard:
                reduce = group
    return ExpertMesh(ep_size, rank % ep_size, edp, mesh, dispatch, reduce)


def check_world_fits(ep_size: int, world: int) -> None:
    """Raise ``ValueError`` naming ``engine.ep_size`` unless the world divides into groups of ``ep_size``."""
    if world % ep_size:
        raise ValueError(
            f"engine.ep_size={ep_size} must divide the world size {world} (the data-parallel ranks "
            "split into expert-parallel groups of ep_size ranks)"
        )


def sparse_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's MoE blocks: the modules whose ``experts`` child holds HF's 3-D expert tensors."""
    return [
        module
        for module in model.modules()
        if all(isinstance(getattr(getattr(module, "experts", None), name, None), nn.Parameter)
               for name in EXPERT_WEIGHTS)
    ]  # fmt: skip


def check_experts_fit(model: nn.Module, ep_size: int) -> None:
    """Raise ``ValueError`` naming ``engine.ep_size`` unless ``model`` has MoE layers whose
    experts split evenly over ``ep_size`` ranks."""
    blocks = sparse_blocks(model)
    if not blocks:
        raise ValueError(
            f"engine.ep_size={ep_size}: {type(model).__name__} has no mixture-of-experts layers to split; "
            "set engine.ep_size=1"
        )
    experts = int(blocks[0].experts.num_experts)
    if experts % ep_size:
        raise ValueError(
            f"engine.ep_size={ep_size} must divide the model's num_experts={experts}: each "
            "expert-parallel rank holds whole experts"
        )


def apply_expert_parallel(
    model: nn.Module, mesh: ExpertMesh, device: torch.device, grad_scale: float
) -> set[nn.Parameter]:
    """Replace every MoE block's experts by this rank's shard of them (:class:`ShardedExperts`,
    on ``device``), in place; returns the shards' parameters, which data parallelism must leave
    alone. ``grad_scale``: ``1 / world``, undoing the engine's loss scaling (module docstring)."""
    check_experts_fit(model, mesh.ep_size)
    placements = [Replicate(), Shard(0)]
    sharded = set()
    for block in sparse_blocks(model):
        experts = block.experts
        local = experts.num_experts // mesh.ep_size
        mine = slice(mesh.ep_rank * local, (mesh.ep_rank + 1) * local)
        weights = {
            name: DTensor.from_local(
                getattr(experts, name).detach()[mine].to(device).clone(),
                mesh.device_mesh,
                placements,
                run_check=False,
            )
            for name in EXPERT_WEIGHTS
        }
        block.experts = ShardedExperts(
            experts, **weights, group=mesh.dispatch_group, grad_scale=grad_scale, grad_group=mesh.reduce_group
        )
        sharded |= {getattr(block.experts, name) for name in EXPERT_WEIGHTS}
    return sharded


def check_expert_training(config: EngineConfig, world: int) -> None:
    """Refuse to train with ``strategy=single`` over expert-parallel ranks (forward passes are
    fine: a frozen reference): their replicated weights' gradients would not be reduced."""
    if config.ep_size > 1 and config.strategy == "single" and world > 1:
        raise ValueError(
            f"engine.ep_size={config.ep_size} with engine.strategy=single: the expert-parallel ranks "
            "are data-parallel ranks with rows of their own, whose replicated weights' gradients "
            "single does not reduce (forward passes only); use engine.strategy=ddp or fsdp2"
        )
