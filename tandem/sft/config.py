"""``SFTConfig``: the SFT trainer's settings, composed from the data, engine and trainer parts."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config.paths import INPUT_PATH, MODEL_PATH, OUTPUT_PATH, path_field
from tandem.config.validation import check_choice, check_positive, check_range
from tandem.controller.factory import BACKENDS
from tandem.controller.resource_pool import ResourcePool
from tandem.engine.config import EngineConfig, check_trainer_parallel_dims
from tandem.run.dataplane import TrainerDataPlaneConfig, check_dataplane
from tandem.sft.data import SFTDataConfig


@dataclass(frozen=True)
class SFTTrainerConfig:
    """The loop (``trainer.*``).

    Attributes:
        global_batch_size: conversations per optimizer step.
        total_steps: optimizer steps to run (0: ``epochs`` passes over the data).
        epochs: passes over the data when ``total_steps`` is 0.
        eval_every / save_every / log_every: in steps (0 turns evaluation / intermediate saving off).
        output_dir: checkpoints under ``checkpoints/``, the final HF model under ``hf_model/``.
        resume: continue from the latest checkpoint in ``output_dir`` when there is one.
        keep_last: checkpoints kept (the newest; 0 keeps every one).
        seed: data order.
        max_skipped_updates_in_a_row: the run stops (naming the step) after this many optimizer
            steps in a row skipped for a non-finite loss or gradient norm.
        backend: ``local`` (in this process for one worker, spawned processes for more),
            ``process`` (always spawned) or ``ray``.
        n_workers: data-parallel workers on the CPU; each takes an equal share of every batch
            (``engine.strategy=single`` becomes DDP; ``fsdp2`` shards the model over them).
        n_gpus_per_node: GPUs to train on, one worker each (0: CPU workers, ``n_workers`` of them).
        experiment / project: the names in ``run.json`` and the report.
        report: keep ``report.html`` (docs/report.md) beside ``metrics.jsonl``.
        report_every: redraw it every this many steps (0: only at the end).
    """

    global_batch_size: int = 16
    total_steps: int = 0
    epochs: int = 1
    eval_every: int = 0
    save_every: int = 0
    log_every: int = 10
    output_dir: str = path_field(OUTPUT_PATH, "outputs/sft")
    resume: bool = False
    keep_last: int = 0
    seed: int = 0
    max_skipped_updates_in_a_row: int = 5
    backend: str = "local"
    n_workers: int = 1
    n_gpus_per_node: int = 0
    experiment: str = "sft"
    project: str = "tandem"
    report: bool = True
    report_every: int = 10

    def __post_init__(self) -> None:
        check_positive("trainer", "global_batch_size", self.global_batch_size)
        check_choice("trainer", "backend", self.backend, BACKENDS)
        check_positive("trainer", "n_workers", self.n_workers)
        check_range("trainer", "n_gpus_per_node", self.n_gpus_per_node, low=0)
        if self.n_gpus_per_node and self.n_workers not in (1, self.n_gpus_per_node):
            raise ValueError(
                f"trainer.n_gpus_per_node={self.n_gpus_per_node} sets one worker per GPU; leave "
                f"trainer.n_workers (={self.n_workers}) unset, it counts CPU workers"
            )
        if self.global_batch_size % self.world_size:
            raise ValueError(
                f"trainer.global_batch_size={self.global_batch_size} must divide evenly over the "
                f"{self.world_size} workers (trainer.n_workers or trainer.n_gpus_per_node)"
            )
        check_positive("trainer", "max_skipped_updates_in_a_row", self.max_skipped_updates_in_a_row)
        check_positive("trainer", "epochs", self.epochs)
        check_positive("trainer", "log_every", self.log_every)
        for name in ("total_steps", "eval_every", "save_every", "report_every", "keep_last"):
            check_range("trainer", name, getattr(self, name), low=0)

    @property
    def world_size(self) -> int:
        """Data-parallel workers: one per GPU, or ``n_workers`` on the CPU."""
        return self.n_gpus_per_node or self.n_workers

    def resource_pool(self) -> ResourcePool:
        """The workers' placement on this machine (one GPU each on GPUs)."""
        return ResourcePool(
            (self.world_size,), gpus_per_process=1.0 if self.n_gpus_per_node else 0.0, name="trainer"
        )


@dataclass(frozen=True)
class SFTConfig:
    """Everything ``tandem sft`` reads; ``model_path`` fills ``engine.model_path`` when that is empty.
    ``dataplane``: whether each step's batch reaches the workers as references (docs/data-plane.md);
    ``plugins``: user files imported before the rest validates (:mod:`tandem.config.plugins`)."""

    model_path: str = path_field(MODEL_PATH)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(lr=1e-4))
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
    dataplane: TrainerDataPlaneConfig = field(default_factory=TrainerDataPlaneConfig)
    plugins: tuple[str, ...] = path_field(INPUT_PATH, ())

    def __post_init__(self) -> None:
        if not (self.model_path or self.engine.model_path):
            raise ValueError("model_path is required (a local HF model directory)")
        check_trainer_parallel_dims("engine", self.engine, self.trainer.world_size)
        check_dataplane(self.dataplane, self.trainer.backend)
        if not self.data.train_path:
            raise ValueError("data.train_path is required (a .parquet or .jsonl file of conversations)")
