"""A mixture-of-experts layer's experts split over a group of ranks: dispatch, grouped compute, combine.

HF's Qwen2-MoE / Qwen3-MoE blocks call ``experts(hidden [N, D], top_k_index [N, k],
top_k_weights [N, k]) -> [N, D]`` after their router. :class:`ShardedExperts` takes that place
when the ``E`` experts are split over the ``P`` ranks of a group, rank ``r`` holding experts
``r * E / P .. (r + 1) * E / P - 1`` (the whole tensors ``gate_up_proj [E, 2I, D]`` and
``down_proj [E, D, I]`` are DTensors sharded on their first dimension):

1. **dispatch**: the ``N * k`` (token, slot) pairs are sorted by expert (stably: token order
   within an expert), and each pair's hidden state is sent to the rank owning its expert with
   one all-to-all of uneven splits (the counts travel first, in a small all-to-all);
2. **grouped compute**: the received rows, regrouped by local expert, run one
   ``act(x W_gate) * (x W_up) W_down`` per expert, as HF's grouped block does;
3. **combine**: a second all-to-all returns each result to its token's rank, where it is
   weighted by the routing weight and summed into the token's row with ``index_add``.

Both all-to-alls are autograd functions whose backward is the reverse exchange, so the hidden
states' and the routing weights' gradients reach the rank that routed them, and each expert
weight's gradient is computed on its owner only (from every rank's tokens of the group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # HF's 3-D expert tensors [E, ...], split on dim 0


def _exchange(tensor: torch.Tensor, send: list[int], receive: list[int], group: ProcessGroup) -> torch.Tensor:
    """Send rows ``sum(send[:j]) .. sum(send[:j + 1]) - 1`` of ``tensor`` to rank ``j`` of
    ``group``; the rows received, ``receive[j]`` from rank ``j``, in rank order."""
    received = tensor.new_empty(sum(receive), *tensor.shape[1:])
    dist.all_to_all_single(received, tensor.contiguous(), receive, send, group=group)
    return received


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, send: list[int], receive: list[int], group: ProcessGroup):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _exchange(tensor, send, receive, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # the reverse exchange: each received row's gradient goes back to the rank that sent it
        return _exchange(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def all_to_all_rows(
    tensor: torch.Tensor, send: list[int], receive: list[int], group: ProcessGroup
) -> torch.Tensor:
    """:func:`_exchange` with autograd: ``tensor [sum(send), ...] -> [sum(receive), ...]``."""
    return _AllToAll.apply(tensor, send, receive, group)


class _ScaledGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale`` and sums it over ``group``."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float, group: ProcessGroup | None):
        ctx.scale, ctx.group = scale, group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad * ctx.scale
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


def grouped_expert_compute(
    rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor, act: nn.Module
) -> torch.Tensor:
    """``rows [M, D]`` sorted by expert, ``counts[e]`` of them for expert ``e`` of
    ``gate_up [e, 2I, D]`` / ``down [e, D, I]``: each row through its expert's gated MLP, ``[M, D]``.

    Every expert runs, on no rows if none came, so each weight gets a (zero) gradient."""
    outputs = []
    for expert, part in enumerate(rows.split(counts)):
        gate, up = F.linear(part, gate_up[expert]).chunk(2, dim=-1)
        outputs.append(F.linear(act(gate) * up, down[expert]))
    return torch.cat(outputs)


class ShardedExperts(nn.Module):
    """HF's ``...Experts`` with its experts split over ``group`` (see the module docstring).

    Args:
        experts: the HF experts module holding every expert (its ``act_fn`` is kept).
        gate_up_proj / down_proj: this rank's experts' weights as DTensors of the whole shapes.
        group: the ranks the experts are split over (this rank's position in it is its shard).
        grad_scale / grad_group: each backward multiplies the local experts' gradient by
            ``grad_scale`` and sums it over ``grad_group`` (the ranks holding the same experts
            for other tokens; ``None``: no other) — see :mod:`tandem.engine.expert_parallel`.
    """

    def __init__(
        self,
        experts: nn.Module,
        gate_up_proj: DTensor,
        down_proj: DTensor,
        group: ProcessGroup,
        grad_scale: float = 1.0,
        grad_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = int(experts.num_experts)
        self.act_fn = experts.act_fn
        self.gate_up_proj = nn.Parameter(gate_up_proj, requires_grad=experts.gate_up_proj.requires_grad)
        self.down_proj = nn.Parameter(down_proj, requires_grad=experts.down_proj.requires_grad)
        self.group, self.grad_scale, self.grad_group = group, grad_scale, grad_group
        self.group_size = dist.get_world_size(group)
        self.local_experts = self.num_experts // self.group_size

    def _local(self, weight: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
        local = _ScaledGradient.apply(weight.to_local(), self.grad_scale, self.grad_group)
        return local.to(dtype)  # the compute dtype (bf16 under FSDP2's policy, which skips these)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``hidden_states [N, D]`` routed to ``top_k_index [N, k]`` with ``top_k_weights [N, k]``:
        the experts' weighted sum per token, ``[N, D]``."""
        top_k = top_k_index.shape[-1]
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // top_k
        per_expert = torch.bincount(experts, minlength=self.num_experts).view(self.group_size, -1)
        received_per_expert = torch.empty_like(per_expert)  # [source rank, local expert]
        dist.all_to_all_single(received_per_expert, per_expert, group=self.group)
        send, receive = per_expert.sum(-1).tolist(), received_per_expert.sum(-1).tolist()
        rows = all_to_all_rows(hidden_states[tokens], send, receive, self.group)
        # received rows come by source rank, then expert: regroup them by expert alone
        local_ids = torch.arange(self.local_experts, device=rows.device).repeat(self.group_size)
        by_expert = torch.argsort(local_ids.repeat_interleave(received_per_expert.flatten()), stable=True)
        computed = grouped_expert_compute(
            rows[by_expert],
            received_per_expert.sum(0).tolist(),
            self._local(self.gate_up_proj, rows.dtype),
            self._local(self.down_proj, rows.dtype),
            self.act_fn,
        )
        results = all_to_all_rows(computed[torch.argsort(by_expert)], receive, send, self.group)
        weighted = results * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, tokens, weighted.to(hidden_states.dtype))
