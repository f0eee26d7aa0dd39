"""``dataplane.*`` of every trainer (RL, SFT, DPO): whether its steps move references instead of
batches (docs/data-plane.md), and which store holds their per-token fields."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.paths import OUTPUT_PATH, path_field
from tandem.dataplane.config import DataPlaneConfig


@dataclass(frozen=True)
class TrainerDataPlaneConfig(DataPlaneConfig):
    """:class:`~tandem.dataplane.DataPlaneConfig` (``engine``, ``directory``) plus the switch.

    Attributes:
        enabled: the workers' stages get a ``BatchRef``, fetch the fields they declare on
            their ranks and keep their outputs there (the RL step: log-probs, reference, teacher,
            critic values, updates; SFT and DPO: the reference scores and the update). RL's draw
            stays where it was generated (the workers in ``sync``, the replicas' blocks in the
            asynchronous modes), or is put into the store once where a stage still builds it on
            the controller; SFT's and DPO's rows are collated on the ranks that read them, from
            per-row scalars. On by default; ``false``: ``Batch`` arguments carry every
            per-token byte through the controller (the path before issue #50).
        directory: as :class:`DataPlaneConfig`'s, marked as a path the run writes (made absolute
            where the run starts).
    """

    directory: str = path_field(OUTPUT_PATH, "/dev/shm")
    enabled: bool = True


def check_dataplane(dataplane: TrainerDataPlaneConfig, backend: str, nnodes: int = 1) -> None:
    """The ``ray`` engine keeps blocks in Ray's object store, so it needs the Ray backend; the
    ``shm`` engine's files are one host's, so trainer ranks on ``nnodes > 1`` hosts need ``ray``."""
    if dataplane.enabled and dataplane.engine == "ray" and backend != "ray":
        raise ValueError(
            f"dataplane.engine=ray needs trainer.backend=ray (got trainer.backend={backend}); "
            "on one machine use dataplane.engine=shm"
        )
    if dataplane.enabled and dataplane.engine == "shm" and nnodes > 1:
        raise ValueError(
            f"trainer.nnodes={nnodes} puts the trainer's ranks on {nnodes} hosts, but "
            f"dataplane.engine=shm keeps each block in one host's {dataplane.directory}, which the "
            "others cannot read: set dataplane.engine=ray (Ray's object store, any node), or "
            "dataplane.enabled=false"
        )
