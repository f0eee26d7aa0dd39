"""The global gradient norm and clipping over parameters that are DTensors on different meshes.

Under tensor parallelism with FSDP2 the parameters live on two meshes: the tensor-parallel
ones on ``(dp_sp, tp)``, the replicated ones (norms) on ``dp_sp`` alone, and without FSDP2 the
latter are plain tensors. ``torch.nn.utils.clip_grad_norm_`` stacks every tensor's norm into
one tensor, which DTensor refuses across meshes; here each gradient's squared local norm is
summed with those of its kind, and each sum is reduced over the mesh dimensions its tensors
are split along (never over a dimension that replicates them, which would count them twice).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.detach().double().square().sum() for t in tensors]).sum()


@torch.no_grad()
def clip_grad_norm_(params: list[torch.Tensor], max_norm: float) -> float:
    """Scale the gradients of ``params`` in place so that their global L2 norm is at most
    ``max_norm`` (``max_norm / (norm + 1e-6)``, as ``torch.nn.utils.clip_grad_norm_``), and
    return the norm before clipping (a collective: every rank of the meshes must call it)."""
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        if isinstance(grad, DTensor):
            split = tuple(
                dim for dim, placement in enumerate(grad.placements) if not placement.is_replicate()
            )
            groups[(id(grad.device_mesh), split)].append(grad)
        else:
            groups[(None, ())].append(grad)
    total = torch.zeros((), dtype=torch.float64)
    for (_, split), members in groups.items():
        local = [g.to_local() if isinstance(g, DTensor) else g for g in members]
        squared = _squared_norm(local)
        for dim in split:
            dist.all_reduce(squared, group=members[0].device_mesh.get_group(dim))
        total += squared.cpu()
    norm = math.sqrt(float(total))
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1.0:
        for grad in grads:
            grad.mul_(coefficient)
    return norm
