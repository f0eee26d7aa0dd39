"""``CheckpointEngineConfig``: how trainer weights reach rollout replicas (``checkpoint_engine.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tandem.config.paths import OUTPUT_PATH, path_field
from tandem.config.validation import check_choice, check_positive

BACKENDS = ("naive", "broadcast", "shared_memory", "files")


@dataclass(frozen=True)
class CheckpointEngineConfig:
    """The weight-sync backend and its settings.

    Attributes:
        backend: ``naive`` (a rollout engine in the trainer's own process: a direct copy),
            ``broadcast`` (a torch.distributed group spanning the sender and the replicas: NCCL
            for CUDA weights, gloo for CPU ones), ``shared_memory`` (replicas on the sender's
            host map the buckets from ``/dev/shm``) or ``files`` (buckets written to
            ``directory``, for replicas that share a filesystem but nothing faster).
        bucket_mb: the most bytes sent at once (a larger tensor travels alone); two buckets
            are in flight, so packing the next overlaps sending this one.
        directory: where ``files`` writes its buckets (required for it); ``shared_memory``
            uses ``/dev/shm`` unless this names another memory-backed directory.
        host: the sender's address as the replicas reach it (the control plane and the
            broadcast rendezvous listen there). Empty (the default): the sender's node address
            in Ray's cluster with the Ray backend, the loopback address otherwise.
        timeout_s: how long either side waits for the other before raising, naming what it waited for.
    """

    key_prefix: ClassVar[str] = "checkpoint_engine"  # its messages' keys start so (tandem.config.build)

    backend: str = "naive"
    bucket_mb: float = 512
    directory: str = path_field(OUTPUT_PATH)
    host: str = ""
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        check_choice("checkpoint_engine", "backend", self.backend, BACKENDS)
        check_positive("checkpoint_engine", "bucket_mb", self.bucket_mb)
        check_positive("checkpoint_engine", "timeout_s", self.timeout_s)
        if self.backend == "files" and not self.directory:
            raise ValueError(
                "checkpoint_engine.directory is required with backend=files (a directory every replica can read)"
            )

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)
