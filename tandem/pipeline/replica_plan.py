"""What the rollout replicas are made of and where they run: the trainer's :class:`ReplicaPlan`
and the local GPU the first replica binds (:func:`replica_first_gpu`)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.agents.config import AgentConfig
from tandem.controller import ResourcePool
from tandem.device import cuda_device_count
from tandem.pipeline.config import PipelineConfig
from tandem.pipeline.source import StepShape
from tandem.rollout.config import RolloutEngineConfig


@dataclass(frozen=True)
class ReplicaPlan:
    """What the asynchronous pipelines take from a run's config, decided by the trainer.

    Attributes:
        pipeline: ``pipeline.*``.
        engine: each replica's rollout engine.
        model_path: the model the replicas load (weights then arrive from the trainer).
        device: ``auto``, ``cpu`` or ``cuda``.
        backend: ``process`` (this machine) or ``ray``.
        pool: the replicas' placement.
        first_gpu: replica 0's local GPU index (:func:`replica_first_gpu`).
        shape: what one draw holds; each group's seeds derive from its seed and the group's
            serial number.
        agent: the agent loops' settings when groups run as agent episodes, else ``None``.
    """

    pipeline: PipelineConfig
    engine: RolloutEngineConfig
    model_path: str
    device: str
    backend: str
    pool: ResourcePool
    first_gpu: int
    shape: StepShape
    agent: AgentConfig | None


def replica_first_gpu(
    pipeline: PipelineConfig, backend: str, device: str, trainer_workers: int, gpus_per_replica: int = 1
) -> int:
    """The local GPU index replica 0 binds: with the local backend the ``trainer_workers`` workers
    of this machine hold GPUs ``0 .. W-1``, so the replicas take the next ones, ``gpus_per_replica``
    each (Ray gives each replica GPUs of its own instead). A machine without enough GPUs wraps
    around, replicas sharing the trainer's; the broadcast backend cannot, since NCCL refuses two
    ranks of one group on one GPU: an error naming the keys."""
    if backend == "ray":
        return 0
    gpus = cuda_device_count()
    on_gpu = gpus > 0 and device != "cpu"
    wanted = trainer_workers + pipeline.rollout_replicas * gpus_per_replica
    if on_gpu and wanted > gpus and pipeline.checkpoint_engine.backend == "broadcast":
        raise ValueError(
            f"{trainer_workers} trainer worker(s) and pipeline.rollout_replicas={pipeline.rollout_replicas} "
            f"({gpus_per_replica} GPU(s) each) need {wanted} GPUs for pipeline.checkpoint_engine.backend=broadcast (NCCL needs a GPU per rank), "
            f"and this machine has {gpus}; use fewer replicas or pipeline.checkpoint_engine.backend=shared_memory"
        )
    return trainer_workers
