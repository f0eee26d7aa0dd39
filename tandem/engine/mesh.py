"""The engine's device mesh: ``(dp, sp)`` or ``(dp, tp)`` over the ranks of the default process group.

Ranks are laid out row-major: rank ``d * sp_size + s`` is sequence-parallel rank ``s`` of
data-parallel rank ``d``, so the ranks of one sequence-parallel group are neighbours (on one
machine, where the all-to-alls are cheapest). The ``dp`` dimension decides which data a rank
sees (its batch shard, the token counts a loss is normalised by); the ``sp`` dimension is
the group a packed row is split over (:mod:`tandem.engine.ulysses`).

Gradients are reduced over every rank, ``dp x sp``: each rank of a sequence-parallel group
holds the gradient of its own tokens only, so the group's gradients must be summed as the
data-parallel ones are (see :mod:`tandem.engine.parallel`).

With tensor parallelism (``tp_size > 1``) the mesh is ``(dp, tp)``, rank ``d * tp_size + t``:
the ranks of a tensor-parallel group (neighbours again) hold the same rows and split each
layer's weights (:mod:`tandem.engine.tensor_parallel`); gradients are reduced over ``dp``
only, each rank's shards being its own. Sequence and tensor parallelism do not combine yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tandem.engine.ulysses import SequenceParallel


@dataclass(frozen=True)
class EngineMesh:
    """This rank's place in the ``(dp, sp)`` or ``(dp, tp)`` mesh.

    Attributes:
        dp_size / sp_size / tp_size: the mesh's shape; ``dp_size * sp_size * tp_size`` ranks
            train together (``sp_size`` or ``tp_size`` is 1).
        dp_rank / sp_rank / tp_rank: this rank's coordinates.
        device_mesh: the torch mesh with dimensions named ``dp`` and ``sp`` (or ``tp``); ``None``
            without sequence or tensor parallelism, where every collective runs over the
            default group.
    """

    dp_size: int
    sp_size: int
    dp_rank: int
    sp_rank: int
    device_mesh: DeviceMesh | None
    tp_size: int = 1
    tp_rank: int = 0

    @classmethod
    def flat(cls, world_size: int = 1, rank: int = 0) -> EngineMesh:
        """``world_size`` data-parallel ranks without sequence parallelism (no torch mesh)."""
        return cls(dp_size=world_size, sp_size=1, dp_rank=rank, sp_rank=0, device_mesh=None)

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
        sharing its rows: ``sp_rank`` and ``tp_rank`` 0)."""
        return self.sp_rank == 0 and self.tp_rank == 0

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The ``dp`` dimension FSDP2 shards over under tensor parallelism (``None`` otherwise:
        the whole world)."""
        return self.device_mesh["dp"] if self.tp_size > 1 else None

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
        """The group of the ranks holding different data (``None``: the default group, which
        it equals without sequence parallelism)."""
        if self.device_mesh is None:
            return None
        return self.device_mesh["dp"].get_group()

    def sequence_parallel(self) -> SequenceParallel | None:
        """The sequence-parallel group a forward splits its row over (``None`` when ``sp_size`` is 1)."""
        if self.sp_size == 1:
            return None
        return SequenceParallel(self.device_mesh["sp"].get_group(), self.sp_size, self.sp_rank)


def build_engine_mesh(device_type: str, sp_size: int, distributed: bool, tp_size: int = 1) -> EngineMesh:
    """The mesh of the default process group's ranks for ``sp_size`` or ``tp_size`` (one rank
    alone when not ``distributed`` or no group is initialised); raises ``ValueError`` naming
    ``engine.sp_size`` / ``engine.tp_size`` when the world does not divide into such groups."""
    world = dist.get_world_size() if distributed and dist.is_initialized() else 1
    if sp_size > 1 and tp_size > 1:
        raise ValueError(
            f"engine.sp_size={sp_size} and engine.tp_size={tp_size}: sequence and tensor parallelism "
            "do not combine yet; set one of them to 1"
        )
    if world % sp_size:
        raise ValueError(
            f"engine.sp_size={sp_size} must divide the world size {world} "
            "(the ranks split into data-parallel groups of sp_size sequence-parallel ranks)"
        )
    if world % tp_size:
        raise ValueError(
            f"engine.tp_size={tp_size} must divide the world size {world} "
            "(the ranks split into data-parallel groups of tp_size tensor-parallel ranks)"
        )
    if sp_size == 1 and tp_size == 1:  # the mesh would be (world, 1): its dp group is the default group
        return EngineMesh.flat(world, dist.get_rank() if world > 1 else 0)
    if tp_size > 1:
        mesh = init_device_mesh(device_type, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
        dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
        return EngineMesh(world // tp_size, 1, dp_rank, 0, mesh, tp_size=tp_size, tp_rank=tp_rank)
    dp_size = world // sp_size
    mesh = init_device_mesh(device_type, (dp_size, sp_size), mesh_dim_names=("dp", "sp"))
    return EngineMesh(dp_size, sp_size, mesh["dp"].get_local_rank(), mesh["sp"].get_local_rank(), mesh)
