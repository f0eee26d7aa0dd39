"""Expert parallelism for Qwen2-MoE / Qwen3-MoE decoders: each MoE layer's experts split over ``ep`` ranks.

The layout is "experts within data parallelism": the ``ep`` ranks of a group are data-parallel
ranks, each with its own rows. The world of ``W`` ranks is the mesh ``(edp, ep) = (W / ep, ep)``,
rank ``d * ep + e`` (the ranks of an expert-parallel group are neighbours). Rank ``e`` of a
group holds experts ``e * E / ep .. (e + 1) * E / ep - 1`` of every MoE layer (DTensors sharded
on the expert dimension, replicated over ``edp``); in each MoE layer the tokens it routes are
sent to the experts' owners and back (:class:`~tandem.models.sharded_experts.ShardedExperts`).
Everything else (attention, norms, embeddings, the router, Qwen2-MoE's shared expert) stays
replicated and is reduced over every rank by DDP or FSDP2, which leave the expert shards alone.

Gradients: the engine multiplies each micro-batch's loss by the number of ranks DDP and FSDP2
average over (``W``, or ``W / tp`` under tensor parallelism) so that their average becomes a
sum. An expert shard's gradient is not averaged by them: in its backward it is multiplied by
the inverse of that number and summed over the ``edp`` group (the ranks holding the same experts
for other groups' tokens), so it becomes the sum over every rank's tokens, as a replicated
weight's is. The gradient norm is reduced over the ``ep`` dimension
(:func:`tandem.engine.grad_norm.clip_grad_norm_`).

With the other meshes:

- **sequence parallelism** (``sp`` of the ``(dp, sp, tp)`` mesh): the ranks of a sequence-parallel group hold different
  tokens too (their shards of a row; the MoE layers run on the shards), so the expert-parallel
  groups are taken from the flattened ``dp x sp`` ranks as above: with ``ep == sp`` a group is
  a sequence-parallel group, a larger ``ep`` spans several;
- **tensor parallelism** (``tp``): the ``tp`` ranks of a data-parallel rank hold the same
  tokens, and each MoE block runs whole on each of them (:mod:`tandem.engine.tensor_parallel`
  splits attention only), so the expert-parallel groups are data-parallel ranks with the same
  tensor-parallel rank: the mesh is ``(edp, ep, tp)``, ``ep`` dividing ``W / tp``. With both,
  the ``dp x sp`` ranks of one tensor-parallel rank hold different tokens: ``edp x ep`` is
  their flattened ``dp_sp`` order, so the same ``(edp, ep, tp)`` layout applies.

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
from tandem.engine.parallel_dims import ParallelDims
from tandem.models.sharded_experts import EXPERT_WEIGHTS, ShardedExperts

EXPERT_BLOCKS = ("mlp",)  # where an HF MoE decoder layer keeps its sparse block (its ``experts``)


@dataclass(frozen=True)
class ExpertMesh:
    """This rank's place in the ``(edp, ep)`` (or ``(edp, ep, tp)``) mesh.

    Attributes:
        ep_size / ep_rank: the expert-parallel group's size and this rank's place in it.
        edp_size: how many groups hold the same experts (``world / (ep_size * tp_size)``).
        device_mesh: ``(edp, ep)`` or ``(edp, ep, tp)``, which the expert DTensors live on.
        dispatch_group: the expert-parallel group the tokens are exchanged in.
        reduce_group: the ranks holding this rank's experts (``None`` when ``edp_size`` is 1).
    """

    ep_size: int
    ep_rank: int
    edp_size: int
    device_mesh: DeviceMesh
    dispatch_group: ProcessGroup
    reduce_group: ProcessGroup | None


def build_expert_mesh(device_type: str, ep_size: int, tp_size: int = 1) -> ExpertMesh:
    """The ``(edp, ep)`` mesh of the default group's ranks, ``(edp, ep, tp)`` under tensor
    parallelism (a collective: every rank calls it).

    Under tensor parallelism the ``tp_size`` neighbouring ranks of a data-parallel rank hold the
    same tokens, so the expert-parallel groups are made of data-parallel ranks with the same
    tensor-parallel rank: rank ``(d * ep_size + e) * tp_size + t``. The ``tp`` ranks hold the same
    experts and compute the same results and gradients. The dispatch and reduce groups are
    groups of their own, never the default one, so their collectives (inside the backward)
    cannot interleave with DDP's or FSDP2's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_world_fits(ep_size, world, tp_size)
    edp = world // (ep_size * tp_size)
    shape, names = (edp, ep_size), ("edp", "ep")
    if tp_size > 1:
        shape, names = (*shape, tp_size), (*names, "tp")
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)

    def rank_at(d: int, e: int, t: int) -> int:
        return (d * ep_size + e) * tp_size + t

    dispatch = reduce = None
    for d in range(edp):  # every rank creates every group, in the same order
        for t in range(tp_size):
            group = dist.new_group([rank_at(d, e, t) for e in range(ep_size)])
            if rank in {rank_at(d, e, t) for e in range(ep_size)}:
                dispatch = group
    if edp > 1:
        for e in range(ep_size):
            for t in range(tp_size):
                group = dist.new_group([rank_at(d, e, t) for d in range(edp)])
                if rank in {rank_at(d, e, t) for d in range(edp)}:
                    reduce = group
    return ExpertMesh(ep_size, (rank // tp_size) % ep_size, edp, mesh, dispatch, reduce)


def check_world_fits(ep_size: int, world: int, tp_size: int = 1) -> None:
    """Raise ``ValueError`` naming ``engine.ep_size`` unless the data-parallel ranks (the world,
    or ``world / tp_size`` under tensor parallelism) divide into groups of ``ep_size``
    (:meth:`~tandem.engine.parallel_dims.ParallelDims.check_experts`)."""
    ParallelDims(world, tp=tp_size, ep=ep_size).check_experts()


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
    alone. ``grad_scale``: one over the ranks DDP / FSDP2 average over, undoing the engine's
    loss scaling (module docstring)."""
    check_experts_fit(model, mesh.ep_size)
    placements = [Replicate(), Shard(0)] + [Replicate()] * (mesh.device_mesh.ndim - 2)  # edp, ep (, tp)
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
