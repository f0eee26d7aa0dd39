"""``dataplane.*``: which store a process puts the blocks it produces into."""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("shm", "ray")


@dataclass(frozen=True)
class DataPlaneConfig:
    """Where per-token data is stored.

    Attributes:
        engine: ``shm`` (one file per block in ``directory``; readers on the same host only) or
            ``ray`` (Ray's object store; readers on any node of the Ray cluster).
        directory: the memory-backed directory of the ``shm`` engine.
    """

    engine: str = "shm"
    directory: str = "/dev/shm"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"dataplane.engine={self.engine!r} is not one of {list(ENGINES)}")
        if not self.directory:
            raise ValueError("dataplane.directory must name a directory (e.g. /dev/shm)")
