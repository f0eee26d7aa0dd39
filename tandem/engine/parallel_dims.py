"""The engine's parallel degrees, validated as arithmetic, and the one named device mesh built from them.

:class:`ParallelDims` holds the degrees of a world of ``W`` ranks:

* ``sp``: Ulysses sequence parallelism (:mod:`tandem.engine.ulysses`): the ranks of a group
  split each packed row's tokens and hold the same rows;
* ``tp``: tensor parallelism (:mod:`tandem.engine.tensor_parallel`): the ranks of a group split
  each layer's weights and hold the same rows (and, with ``sp``, the same tokens);
* ``dp = W / (sp * tp)``: data parallelism, the ranks holding different rows. DDP replicates the
  model over them, FSDP2 shards it; either way gradients are reduced over ``dp x sp`` (the ranks
  of a sequence-parallel group hold the gradients of their own tokens), never over ``tp`` (a
  tensor-parallel rank's gradients are of its own shards);
* ``ep``: expert parallelism (:mod:`tandem.engine.expert_parallel`): each MoE layer's experts split
  over ``ep`` of the ``dp x sp`` ranks of one tensor-parallel slice (the ranks holding different
  tokens; torchtitan's layout), ``edp = dp * sp / ep`` groups of them holding the same experts.

Ranks are laid out ``(dp, sp, tp)`` row-major: rank ``(d * sp + s) * tp + t``, so a tensor-parallel
group's ranks are neighbours, then a sequence-parallel group's (on one machine, where their
collectives are cheapest). The ranks of tensor-parallel slice ``t`` holding different tokens are
``f = d * sp + s`` (the flattened ``dp_sp`` dimension), and the expert-parallel groups are runs of
``ep`` consecutive ``f``: ``f = i * ep + e`` is expert-parallel rank ``e`` of group ``i``. With
``ep`` dividing ``sp`` a group lies inside a sequence-parallel group, with ``sp`` dividing ``ep``
it spans whole ones; any ``ep`` dividing ``dp * sp`` works.

:meth:`ParallelDims.build_mesh` builds the one torch mesh, its dimensions named ``dp``, ``sp`` and
``tp``, with ``dp_sp`` flattened (:func:`gradient_mesh` returns that flattened mesh itself, which
FSDP2 shards over; torch deprecates slicing it from the root mesh by name);
:meth:`ParallelDims.expert_mesh` views that ``dp_sp`` dimension as ``(edp, ep)`` (the same ranks,
by name, no mesh built apart).

Everything here but the two mesh builders is arithmetic, with no process group: the engine
(which knows the world) and the trainers' configs (which know their workers) check the same
rules, their messages naming ``<owner>.sp_size`` / ``tp_size`` / ``ep_size``; dispatch learns each
rank's place from :meth:`ParallelDims.mesh_rank`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tandem.controller.dispatch import MeshRank

MESH_DIMS = ("dp", "sp", "tp")
GRADIENT_DIM = "dp_sp"  # the flattened dp x sp dimension gradients reduce over and FSDP2 shards over
EXPERT_DIMS = ("edp", "ep")  # dp_sp viewed as (groups holding the same experts, a group's ranks)


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of ``world`` ranks (module docstring): ``sp``, ``tp``, ``ep``; ``dp`` follows."""

    world: int
    sp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        """The data-parallel degree: ``world / (sp * tp)``."""
        return self.world // (self.sp * self.tp)

    @property
    def gradient_ranks(self) -> int:
        """The ranks whose gradients DDP or FSDP2 average: ``dp * sp`` (they hold different tokens)."""
        return self.dp * self.sp

    @property
    def edp(self) -> int:
        """How many expert-parallel groups of a tensor-parallel slice hold the same experts: ``dp * sp / ep``."""
        return self.gradient_ranks // self.ep

    @property
    def splits(self) -> bool:
        """Whether rows are split over sequence- or tensor-parallel ranks."""
        return self.sp > 1 or self.tp > 1

    @property
    def meshed(self) -> bool:
        """Whether a torch mesh is needed: rows split (:attr:`splits`) or experts (``ep > 1``)."""
        return self.splits or self.ep > 1

    def check(self, owner: str = "engine", world: str | None = None, unit: str = "ranks") -> None:
        """Raise ``ValueError`` naming ``<owner>.sp_size`` / ``tp_size`` / ``ep_size`` unless the
        world divides into the mesh. ``world``: how the messages name it (``the world size 4``
        by default; a trainer's ``the 4 workers``); ``unit``: what its members are called."""
        where = world or f"the world size {self.world}"
        if self.world % self.sp:
            raise ValueError(
                f"{owner}.sp_size={self.sp} must divide {where} (the {unit} split into data-parallel "
                "groups of sp_size sequence-parallel ranks)"
            )
        if self.world % self.tp:
            raise ValueError(
                f"{owner}.tp_size={self.tp} must divide {where}: each data-parallel rank is tp_size {unit} "
                "holding the same rows"
            )
        if self.world % (self.sp * self.tp):
            raise ValueError(
                f"{owner}.sp_size={self.sp} x {owner}.tp_size={self.tp} = {self.sp * self.tp} must divide "
                f"{where}: each data-parallel rank is sp_size x tp_size {unit} (laid out (dp, sp, tp))"
            )
        self.check_experts(owner, where, unit)

    def check_experts(self, owner: str = "engine", world: str | None = None, unit: str = "ranks") -> None:
        """Raise ``ValueError`` naming ``<owner>.ep_size`` unless the ranks holding different
        tokens (the world, or ``world / tp_size`` under tensor parallelism) split into groups of ``ep``."""
        where = world or f"the world size {self.world}"
        if self.tp > 1 and (self.world // self.tp) % self.ep:
            raise ValueError(
                f"{owner}.ep_size={self.ep} must divide the {self.world // self.tp} data-parallel {unit} "
                f"({where} over {owner}.tp_size={self.tp}): the expert-parallel groups are the dp x sp "
                f"{unit} of one tensor-parallel slice, each with tokens of its own"
            )
        if self.world % self.ep:
            raise ValueError(
                f"{owner}.ep_size={self.ep} must divide {where} (the data-parallel {unit} "
                f"split into expert-parallel groups of ep_size {unit})"
            )

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, sp_rank, tp_rank)`` of ``rank`` in the row-major ``(dp, sp, tp)`` layout."""
        return rank // (self.sp * self.tp), (rank // self.tp) % self.sp, rank % self.tp

    def mesh_rank(self, rank: int) -> MeshRank:
        """``rank``'s place for ``mesh_dispatch``: its data-parallel rank of ``dp``, collected when it
        is the first rank of its ``sp x tp`` block (the ranks sharing its rows; experts split no rows)."""
        dp_rank, sp_rank, tp_rank = self.coordinates(rank)
        return MeshRank(dp_rank, self.dp, is_collect=sp_rank == 0 and tp_rank == 0)

    def expert_coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(edp_rank, ep_rank, tp_rank)`` of ``rank``: its ``dp_sp`` index ``rank // tp`` is
        ``edp_rank * ep + ep_rank`` (module docstring)."""
        token_rank = rank // self.tp
        return token_rank // self.ep, token_rank % self.ep, rank % self.tp

    def expert_groups(self) -> list[list[int]]:
        """Every expert-parallel group's ranks, in expert-parallel rank order; groups ordered by
        ``edp_rank``, then tensor-parallel rank."""
        return [
            [(group * self.ep + e) * self.tp + t for e in range(self.ep)]
            for group in range(self.edp)
            for t in range(self.tp)
        ]

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The ``(dp, sp, tp)`` mesh of the default group's ranks, with ``dp_sp`` flattened (a
        collective: every rank calls it, after :meth:`check`)."""
        mesh = init_device_mesh(device_type, (self.dp, self.sp, self.tp), mesh_dim_names=MESH_DIMS)
        gradient_mesh(mesh)
        return mesh

    def expert_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """``mesh``'s (:meth:`build_mesh`) ``dp_sp`` dimension of this rank's tensor-parallel slice
        viewed as ``(edp, ep)`` (a collective). Its groups are groups of their own, never the
        default one, even where ``ep`` spans the world: the experts' exchanges run inside the
        backward, where they must not interleave with DDP's or FSDP2's collectives."""
        own_groups = {name: dist.get_backend() for name in EXPERT_DIMS}
        token_ranks = gradient_mesh(mesh)  # the one build_mesh made
        return token_ranks._unflatten(0, (self.edp, self.ep), EXPERT_DIMS, backend_override=own_groups)


def gradient_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh``'s (:meth:`ParallelDims.build_mesh`) flattened ``dp_sp`` dimension, the ranks holding
    different tokens. Made once (a collective, in ``build_mesh``), then the same mesh looked up:
    torch deprecates slicing a flattened dimension from the root mesh (``mesh["dp_sp"]``) and asks
    callers to keep the flattened mesh itself, which ``_flatten`` returns."""
    return mesh["dp", "sp"]._flatten(GRADIENT_DIM)
