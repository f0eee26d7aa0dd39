"""Ulysses sequence parallelism: the collectives that move a packed row between sequence and
head shards, autograd-aware, and :class:`SequenceParallel`, a forward's place in its group.

A packed row of ``T`` tokens (``T`` a multiple of the group's size ``P``) is split along the
sequence: rank ``r`` holds tokens ``r * T / P .. (r + 1) * T / P - 1`` and runs embeddings,
norms and MLPs on them alone. Attention needs every token of a sequence, so
:func:`all_to_all` trades the sequence shard for a head shard around it (DeepSpeed-Ulysses,
Jacobs et al. 2023): each rank then attends over the whole row with ``1 / P`` of the heads.
The outputs the loss reads are put back together with :func:`gather_sequence` or
:func:`sum_disjoint`; both assume what holds in the engine: every rank of the group computes
the same loss from the same whole tensor, so the whole tensor's gradient is already on every
rank and each keeps the part it computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tandem.engine.packing import Predictions


def _all_to_all(tensor: torch.Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Chunk ``scatter_dim`` into ``P`` pieces, send piece ``j`` to rank ``j`` and concatenate
    the pieces received along ``gather_dim``, in rank order."""
    size = dist.get_world_size(group)
    sent = torch.stack(tensor.chunk(size, dim=scatter_dim)).contiguous()  # [P, ...piece]
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(tensor, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # the inverse exchange: the gradient of each received piece goes back to its sender
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(tensor: torch.Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``tensor`` along ``scatter_dim`` over the ``P`` ranks of ``group`` and join what
    they send along ``gather_dim``; the backward is the inverse exchange.

    Attention's use: ``[1, H, T / P, D]`` with ``scatter_dim=1, gather_dim=2`` becomes
    ``[1, H / P, T, D]`` (this rank's heads over the whole row), and ``[1, T, H / P, D]``
    with ``scatter_dim=1, gather_dim=2`` goes back to ``[1, T / P, H, D]``.
    """
    return _AllToAll.apply(tensor, group, scatter_dim, gather_dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: ProcessGroup, dim: int):
        ctx.group, ctx.dim, ctx.length = group, dim, tensor.shape[dim]
        pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, tensor.contiguous(), group=group)
        return torch.cat(pieces, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = dist.get_rank(ctx.group) * ctx.length
        return grad.narrow(ctx.dim, start, ctx.length), None, None


def gather_sequence(tensor: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """The shards of ``group``'s ranks joined along ``dim`` in rank order: ``[..., T / P, ...]``
    -> ``[..., T, ...]``. The backward keeps this rank's slice of the whole tensor's gradient
    (every rank computes the same loss from the whole tensor, so each already holds all of it)."""
    return _GatherSequence.apply(tensor, group, dim)


class _SumDisjoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: ProcessGroup):
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_disjoint(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The sum over ``group`` of tensors of one shape that each hold their rank's entries and
    zeros elsewhere: the whole tensor, exactly (``x + 0 == x``). The backward passes the
    gradient through: as with :func:`gather_sequence`, every rank holds the whole gradient and
    the zeros it did not compute pass it nowhere."""
    return _SumDisjoint.apply(tensor, group)


@dataclass(frozen=True)
class SequenceParallel:
    """A forward split along the sequence over ``group``: this rank is ``rank`` of ``size``.

    The model receives the whole packed row (``input_ids``, ``position_ids`` ``[1, T]``,
    ``T`` a multiple of ``size``), runs the decoder on its shard and hands back outputs of
    the whole row.
    """

    group: ProcessGroup
    size: int
    rank: int

    def bounds(self, total: int) -> tuple[int, int]:
        """``(start, end)``: the packed positions this rank holds of a row of ``total`` tokens."""
        if total % self.size:
            raise ValueError(f"a packed row of {total} tokens does not split over {self.size} ranks")
        length = total // self.size
        return self.rank * length, (self.rank + 1) * length

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of ``tensor`` along the sequence dimension ``dim``: ``[B, T, ...]``
        -> ``[B, T / P, ...]`` (``dim=2`` for M-RoPE positions ``[3, 1, T]``)."""
        start, end = self.bounds(tensor.shape[dim])
        return tensor.narrow(dim, start, end - start)

    def check_same_rows(self, input_ids: torch.Tensor, device: torch.device) -> None:
        """Raise ``ValueError`` on every rank unless every rank of the group was handed the same
        ``input_ids [B, S]``: a group splits rows that its ranks share, so they must be
        dispatched by data-parallel rank. ``device``: the one the group's collectives run on."""
        check_same_rows(input_ids, self.group, self.size, "sequence-parallel", "split the rows they share", device)

    def split_predictions(self, predictions: Predictions, total: int) -> tuple[Predictions, torch.Tensor]:
        """The predictions whose source hidden state this rank holds, sources counted from its
        shard's start (targets stay packed positions of the whole row), and their indices
        ``[N_r]`` among all ``N`` predictions."""
        start, end = self.bounds(total)
        mine = ((predictions.sources >= start) & (predictions.sources < end)).nonzero().flatten()
        return Predictions(predictions.sources[mine] - start, predictions.targets[mine]), mine

    def gather_predicted(self, values: torch.Tensor, mine: torch.Tensor, count: int) -> torch.Tensor:
        """``values [N_r, ...]`` of this rank's predictions (indices ``mine``) as ``[count, ...]``
        values of all predictions, every rank's included."""
        placed = values.new_zeros(count, *values.shape[1:]).index_put((mine,), values)
        return sum_disjoint(placed, self.group)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor [B, T / P, ...]`` of this rank's shard as ``[B, T, ...]`` of the whole row."""
        return gather_sequence(tensor, self.group, dim=1)


def check_same_rows(
    input_ids: torch.Tensor, group: ProcessGroup, size: int, kind: str, why: str, device: torch.device
) -> None:
    """Raise ``ValueError`` on every rank unless every one of the ``size`` ranks of ``group`` (a
    ``kind`` group, whose ranks ``why``) was handed the same ``input_ids [B, S]``, compared by
    shape and two checksums (one small all-gather). The checksums are taken where ``input_ids``
    are (the CPU, before the engine moves the batch) and gathered on ``device``, the group's
    (NCCL's groups take no CPU tensors)."""
    ids = input_ids.to(torch.int64).flatten()
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.int64, device=ids.device) % 65521
    shape = torch.tensor(input_ids.shape, device=ids.device)
    mine = torch.stack([*shape, ids.sum(), (ids * weights).sum()]).to(device)
    seen = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(seen, mine, group=group)
    if any(not torch.equal(other, seen[0]) for other in seen[1:]):
        raise ValueError(
            f"the {size} ranks of a {kind} group were handed different rows; they {why}, so a batch "
            "must be split by data-parallel rank (engine.mesh.dp_rank), every rank of a group receiving "
            "the same rows"
        )
