"""The engine's place in the ``(dp, sp, tp)`` mesh: :class:`EngineMesh`, a view of this rank over
the one named device mesh :class:`~tandem.engine.parallel_dims.ParallelDims` builds (and, under
expert parallelism, over that mesh's ``dp_sp`` dimension viewed as ``(edp, ep)``).

Ranks are laid out row-major: rank ``(d * sp_size + s) * tp_size + t`` is tensor-parallel rank
``t`` of sequence-parallel rank ``s`` of data-parallel rank ``d``, so the ranks of a
tensor-parallel group are neighbours, and those of a sequence-parallel group next. The ``dp``
dimension decides which data a rank sees (its batch shard, the token counts a loss is
normalised by); the ``sp`` dimension is the group a packed row is split over
(:mod:`tandem.engine.ulysses`); the ``tp`` dimension the group each layer's weights are split
over (:mod:`tandem.engine.tensor_parallel`). The ranks of one ``sp x tp`` block hold the same rows.

Gradients are reduced over ``dp x sp`` (the flattened ``dp_sp`` dimension): each rank of a
sequence-parallel group holds the gradient of its own tokens only, so the group's gradients
are summed as the data-parallel ones are (see :mod:`tandem.engine.parallel`); a
tensor-parallel rank's gradients are of its own shards (or, for a replicated weight, the same
on every rank of the group), so they are not reduced over ``tp``. An expert shard's gradient is
summed over ``edp`` (the ranks holding the same experts: :mod:`tandem.engine.expert_parallel`).

Where each rank is (its data-parallel rank, whether it reports its rows, its expert group) is
:class:`ParallelDims`' arithmetic; the torch meshes are built from it and agree with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from tandem.engine.parallel_dims import MESH_DIMS, ParallelDims, gradient_mesh
from tandem.engine.ulysses import SequenceParallel


@dataclass(frozen=True)
class EngineMesh:
    """This rank's place in the ``(dp, sp, tp)`` mesh.

    Attributes:
        dp_size / sp_size / tp_size: the mesh's shape; ``dp_size * sp_size * tp_size`` ranks
            train together.
        dp_rank / sp_rank / tp_rank: this rank's coordinates.
        device_mesh: the torch mesh with dimensions named ``dp``, ``sp`` and ``tp`` (and the
            flattened ``dp_sp``); ``None`` without sequence, tensor or expert parallelism, where
            every collective runs over the default group.
        ep_size / ep_rank: the expert-parallel group's size and this rank's place in it.
        expert_mesh: ``device_mesh``'s ``dp_sp`` dimension (of this rank's tensor-parallel slice)
            viewed as ``(edp, ep)``, which the expert shards live on; ``None`` when ``ep_size`` is 1.
    """

    dp_size: int
    sp_size: int
    dp_rank: int
    sp_rank: int
    device_mesh: DeviceMesh | None
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    expert_mesh: DeviceMesh | None = None

    @classmethod
    def flat(cls, world_size: int = 1, rank: int = 0) -> EngineMesh:
        """``world_size`` data-parallel ranks without sequence or tensor parallelism (no torch mesh)."""
        return cls(dp_size=world_size, sp_size=1, dp_rank=rank, sp_rank=0, device_mesh=None)

    @property
    def dims(self) -> ParallelDims:
        """The mesh's degrees, whose arithmetic places every rank."""
        return ParallelDims(self.world_size, self.sp_size, self.tp_size, self.ep_size)

    @property
    def rank(self) -> int:
        """This rank in the row-major ``(dp, sp, tp)`` layout: ``(dp_rank * sp_size + sp_rank) * tp_size + tp_rank``."""
        return (self.dp_rank * self.sp_size + self.sp_rank) * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        """Every rank of the mesh: ``dp_size * sp_size * tp_size``."""
        return self.dp_size * self.sp_size * self.tp_size

    @property
    def gradient_ranks(self) -> int:
        """The ranks whose gradients DDP or FSDP2 average: ``dp_size * sp_size`` (a
        tensor-parallel rank's gradients are of its own shards)."""
        return self.dp_size * self.sp_size

    @property
    def collects(self) -> bool:
        """Whether this rank reports its data-parallel rank's results (the first of the ranks
        sharing its rows: :meth:`ParallelDims.mesh_rank`)."""
        return self.dims.mesh_rank(self.rank).is_collect

    @property
    def expert_dispatch_group(self) -> ProcessGroup:
        """The expert-parallel group the MoE layers exchange tokens in (its ``ep`` dimension)."""
        return self._experts["ep"].get_group()

    @property
    def expert_reduce_group(self) -> ProcessGroup | None:
        """The ranks holding this rank's experts for other tokens, over which an expert shard's
        gradient is summed (its ``edp`` dimension); ``None`` when it is this rank alone."""
        return self._experts["edp"].get_group() if self.dims.edp > 1 else None

    @property
    def _experts(self) -> DeviceMesh:
        if self.expert_mesh is None:
            raise ValueError("the engine's experts are not split (engine.ep_size=1): no expert mesh")
        return self.expert_mesh

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards over under tensor parallelism: the flattened ``dp_sp``
        dimension, whose DTensor shards it shards again (``None`` otherwise: the whole world,
        which is ``dp x sp`` then)."""
        return gradient_mesh(self.device_mesh) if self.tp_size > 1 else None

    @property
    def tp_group(self) -> ProcessGroup | None:
        """The tensor-parallel group (``None`` without tensor parallelism)."""
        return self.device_mesh["tp"].get_group() if self.tp_size > 1 else None

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The ``tp`` dimension the weights are split over (``None`` without tensor parallelism)."""
        return self.device_mesh["tp"] if self.tp_size > 1 else None

    @property
    def dp_group(self) -> ProcessGroup | None:
        """The group of the ranks holding different rows (``None``: the default group, which
        it equals without sequence or tensor parallelism)."""
        if self.device_mesh is None:
            return None
        return self.device_mesh["dp"].get_group()

    def sequence_parallel(self) -> SequenceParallel | None:
        """The sequence-parallel group a forward splits its row over (``None`` when ``sp_size`` is 1)."""
        if self.sp_size == 1:
            return None
        return SequenceParallel(self.device_mesh["sp"].get_group(), self.sp_size, self.sp_rank)


def build_engine_mesh(
    device_type: str, sp_size: int, distributed: bool, tp_size: int = 1, ep_size: int = 1
) -> EngineMesh:
    """The mesh of the default process group's ranks for ``sp_size``, ``tp_size`` and ``ep_size``
    (one rank alone when not ``distributed`` or no group is initialised); raises ``ValueError``
    naming ``engine.sp_size`` / ``tp_size`` / ``ep_size`` when the world does not divide into such
    groups (:meth:`ParallelDims.check`)."""
    world = dist.get_world_size() if distributed and dist.is_initialized() else 1
    dims = ParallelDims(world, sp_size, tp_size, ep_size)
    dims.check("engine")
    if not dims.meshed:  # the mesh would be (world, 1, 1): its dp group is the default group
        return EngineMesh.flat(world, dist.get_rank() if world > 1 else 0)
    mesh = dims.build_mesh(device_type)
    dp_rank, sp_rank, tp_rank = (mesh[name].get_local_rank() for name in MESH_DIMS)
    experts = dims.expert_mesh(mesh) if ep_size > 1 else None
    ep_rank = experts["ep"].get_local_rank() if experts is not None else 0
    return EngineMesh(
        dims.dp, sp_size, dp_rank, sp_rank, mesh, tp_size, tp_rank, ep_size, ep_rank, expert_mesh=experts
    )
