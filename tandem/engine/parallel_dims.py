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
* ``ep``: expert parallelism (:mod:`tandem.engine.expert_parallel`), within the ``dp x sp``
  ranks that hold different tokens (its mesh is built there).

Ranks are laid out ``(dp, sp, tp)`` row-major: rank ``(d * sp + s) * tp + t``, so a tensor-parallel
group's ranks are neighbours, then a sequence-parallel group's (on one machine, where their
collectives are cheapest). :meth:`ParallelDims.build_mesh` builds the torch mesh with
dimensions named ``dp``, ``sp`` and ``tp`` and the flattened ``dp_sp``, sliced by name.

Everything here but :meth:`~ParallelDims.build_mesh` is arithmetic, with no process group: the
engine (which knows the world) and the trainers' configs (which know their workers) check the
same rules, their messages naming ``<owner>.sp_size`` / ``tp_size`` / ``ep_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp", "sp", "tp")
GRADIENT_DIM = "dp_sp"  # the flattened dp x sp dimension gradients reduce over and FSDP2 shards over


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
    def splits(self) -> bool:
        """Whether a mesh is needed: rows split over sequence- or tensor-parallel ranks."""
        return self.sp > 1 or self.tp > 1

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
        self.check_experts(owner)

    def check_experts(self, owner: str = "engine") -> None:
        """Raise ``ValueError`` naming ``<owner>.ep_size`` unless the ranks holding different
        tokens (the world, or ``world / tp_size`` under tensor parallelism) split into groups of ``ep``."""
        if self.tp > 1 and (self.world // self.tp) % self.ep:
            raise ValueError(
                f"{owner}.ep_size={self.ep} must divide the {self.world // self.tp} data-parallel ranks (the "
                f"world size {self.world} over {owner}.tp_size={self.tp}): the expert-parallel groups are "
                "data-parallel ranks, each with rows of its own"
            )
        if self.world % self.ep:
            raise ValueError(
                f"{owner}.ep_size={self.ep} must divide the world size {self.world} (the data-parallel ranks "
                "split into expert-parallel groups of ep_size ranks)"
            )

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, sp_rank, tp_rank)`` of ``rank`` in the row-major ``(dp, sp, tp)`` layout."""
        return rank // (self.sp * self.tp), (rank // self.tp) % self.sp, rank % self.tp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The ``(dp, sp, tp)`` mesh of the default group's ranks, with ``dp_sp`` flattened (a
        collective: every rank calls it, after :meth:`check`)."""
        mesh = init_device_mesh(device_type, (self.dp, self.sp, self.tp), mesh_dim_names=MESH_DIMS)
        mesh["dp", "sp"]._flatten(GRADIENT_DIM)
        return mesh
