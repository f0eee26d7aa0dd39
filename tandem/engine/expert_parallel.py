"""Expert parallelism for Qwen2-MoE / Qwen3-MoE decoders: each MoE layer's experts split over ``ep`` ranks.

The layout is "experts within data parallelism" (torchtitan's): the ``ep`` ranks of a group hold
different tokens, each its own. They are taken from the ``dp x sp`` ranks of one tensor-parallel
slice, the flattened ``dp_sp`` dimension of the engine's one ``(dp, sp, tp)`` mesh, viewed as
``(edp, ep) = (dp * sp / ep, ep)``: the ``dp_sp`` index ``i * ep + e`` is rank ``e`` of group
``i`` (:class:`~tandem.engine.parallel_dims.ParallelDims` owns the arithmetic and builds the
view; no mesh is built apart). Rank ``e`` of a group holds experts ``e * E / ep .. (e + 1) * E /
ep - 1`` of every MoE layer (DTensors sharded on the expert dimension over ``ep``, replicated
over ``edp``); in each MoE layer the tokens it routes are sent to the experts' owners and back
(:class:`~tandem.models.sharded_experts.ShardedExperts`). Everything else (attention, norms,
embeddings, the router, Qwen2-MoE's shared expert) stays replicated (or tensor-parallel) and is
reduced by DDP or FSDP2, which leave the expert shards alone.

Gradients: the engine multiplies each micro-batch's loss by the number of ranks DDP and FSDP2
average over (``dp * sp``) so that their average becomes a sum. An expert shard's gradient is not
averaged by them: in its backward it is multiplied by the inverse of that number and summed over
the ``edp`` group (the ranks holding the same experts for other groups' tokens), so it becomes
the sum over every rank's tokens, as a replicated weight's is. The gradient norm is reduced over
the ``ep`` dimension (:func:`tandem.engine.grad_norm.clip_grad_norm_`).

With the other degrees, from the same rule:

- **sequence parallelism**: the ranks of a sequence-parallel group hold different tokens (their
  shards of a row; the MoE layers run on the shards): with ``ep == sp`` a group is a
  sequence-parallel group, a larger ``ep`` spans several, a smaller one splits one;
- **tensor parallelism**: the ``tp`` ranks of a data-parallel rank hold the same tokens, and each
  MoE block runs whole on each of them (:mod:`tandem.engine.tensor_parallel` splits attention
  only), so each tensor-parallel slice has its own expert groups, ``ep`` dividing ``dp * sp``:
  rank ``((i * ep + e) * tp + t`` is rank ``e`` of group ``i`` of slice ``t``. The ``tp`` ranks
  hold the same experts and compute the same results and gradients.

The shards are DTensors of the whole tensors' shapes, so checkpoints (DCP) reshard between any
``ep_size`` and exports and weight syncs gather one whole tensor at a time with
``full_tensor()``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from tandem.engine.config import EngineConfig
from tandem.engine.mesh import EngineMesh
from tandem.models.sharded_experts import EXPERT_WEIGHTS, ShardedExperts

EXPERT_BLOCKS = ("mlp",)  # where an HF MoE decoder layer keeps its sparse block (its ``experts``)


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
    model: nn.Module, mesh: EngineMesh, device: torch.device, grad_scale: float
) -> set[nn.Parameter]:
    """Replace every MoE block's experts by this rank's shard of them (:class:`ShardedExperts`,
    on ``device``, DTensors on ``mesh.expert_mesh``), in place; returns the shards' parameters,
    which data parallelism must leave alone. ``grad_scale``: one over the ranks DDP / FSDP2
    average over, undoing the engine's loss scaling (module docstring)."""
    check_experts_fit(model, mesh.ep_size)
    placements = [Replicate(), Shard(0)]  # edp, ep
    sharded = set()
    for block in sparse_blocks(model):
        experts = block.experts
        local = experts.num_experts // mesh.ep_size
        mine = slice(mesh.ep_rank * local, (mesh.ep_rank + 1) * local)
        weights = {
            name: DTensor.from_local(
                getattr(experts, name).detach()[mine].to(device).clone(),
                mesh.expert_mesh,
                placements,
                run_check=False,
            )
            for name in EXPERT_WEIGHTS
        }
        block.experts = ShardedExperts(
            experts,
            **weights,
            group=mesh.expert_dispatch_group,
            grad_scale=grad_scale,
            grad_group=mesh.expert_reduce_group,
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
