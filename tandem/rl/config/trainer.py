"""``trainer.*``: steps, schedule, workers, logging, checkpoints and outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.config.paths import OUTPUT_PATH, path_field
from tandem.config.validation import check_choice, check_positive, check_range
from tandem.device import check_device_setting

if TYPE_CHECKING:
    pass


BACKENDS = ("local", "ray")


RESUME_MODES = ("auto", "disable")


LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


@dataclass(frozen=True)
class TrainerConfig:
    """The loop (``trainer.*``).

    Attributes:
        total_steps: RL steps (0: ``total_epochs`` passes over the prompts).
        total_epochs: passes over the training prompts when ``total_steps`` is 0.
        device: where every worker computes: ``auto`` (CUDA when the worker sees a GPU), ``cpu``
            or ``cuda`` (each worker its own GPU; see :mod:`tandem.device`).
        backend: ``local`` (in-process for one worker, spawned processes for more) or ``ray``.
        n_workers: data-parallel workers per node on the CPU (each holds actor, rollout and reference).
        nnodes: machines (more than one needs ``backend=ray``).
        n_gpus_per_node: GPUs per node, one worker each (0: CPU workers, ``n_workers`` per node);
            with the Ray backend each worker reserves one GPU and sees only it.
        balance_batch: reorder each step's sequences so every worker gets nearly the same
            number of tokens (:mod:`tandem.rl.balance`); changes no result.
        val_every / save_every: in steps (0: off); ``val_before_train`` evaluates at step 0.
        keep_last: checkpoints kept (older ones are deleted).
        max_skipped_updates_in_a_row: the run stops (naming the step) after this many optimizer
            steps in a row skipped for a non-finite loss or gradient norm; single ones are skipped
            and counted in ``actor/skipped_updates``.
        resume: ``auto`` (latest checkpoint in ``output_dir`` if any), ``disable``, or a checkpoint path.
        output_dir: checkpoints, metrics, the report and the exported model.
        loggers: any of ``console``, ``jsonl``, ``tensorboard``, ``wandb``, ``mlflow``.
        project / experiment: names for wandb/MLflow.
        seed: data order, sampling seeds and initialisation.
        report: write ``report.html`` (docs/report.md): redrawn during training and at the end,
            beside ``run.json`` (what produced the run) and ``status.json`` (where it is).
            Needs the ``jsonl`` logger, whose ``metrics.jsonl`` it draws.
        report_every: redraw the report every this many steps (and after each validation); 0:
            only at the end.
        export_hf: save the final policy as a plain HF model directory.
        profile_steps: steps to record with the PyTorch profiler: every trainer worker writes a
            Chrome trace per step, ``<profile_dir>/step_<N>/rank<R>.json`` (see docs/rl.md).
        profile_dir: where the traces go (empty: ``<output_dir>/profile``).
        lr_schedule_unit: what one learning-rate schedule step is: an ``optimizer_step`` (the
            warmup and ``total_steps`` count optimizer steps) or an RL ``step`` (one schedule step
            after each step's updates, as verl does; every mini-batch of a step uses the same rate).
    """

    total_steps: int = 0
    total_epochs: int = 1
    device: str = "auto"
    backend: str = "local"
    n_workers: int = 1
    nnodes: int = 1
    n_gpus_per_node: int = 0
    balance_batch: bool = True
    val_every: int = 0
    val_before_train: bool = True
    save_every: int = 0
    keep_last: int = 2
    max_skipped_updates_in_a_row: int = 5
    resume: str = "auto"
    output_dir: str = path_field(OUTPUT_PATH, "outputs/rl")
    loggers: tuple[str, ...] = ("console", "jsonl")
    project: str = "tandem"
    experiment: str = "run"
    seed: int = 0
    report: bool = True
    report_every: int = 10
    export_hf: bool = True
    profile_steps: tuple[int, ...] = ()
    profile_dir: str = path_field(OUTPUT_PATH)
    lr_schedule_unit: str = "optimizer_step"

    def __post_init__(self) -> None:
        check_range("trainer", "total_steps", self.total_steps, low=0)
        check_range("trainer", "report_every", self.report_every, low=0)
        for step in self.profile_steps:
            if not isinstance(step, int) or step < 1:
                raise ValueError(
                    f"trainer.profile_steps must hold step numbers >= 1, got {list(self.profile_steps)}"
                )
        check_positive("trainer", "total_epochs", self.total_epochs)
        check_device_setting("trainer", "device", self.device)
        check_choice("trainer", "backend", self.backend, BACKENDS)
        check_choice("trainer", "lr_schedule_unit", self.lr_schedule_unit, ["optimizer_step", "step"])
        check_positive("trainer", "n_workers", self.n_workers)
        check_positive("trainer", "nnodes", self.nnodes)
        check_range("trainer", "n_gpus_per_node", self.n_gpus_per_node, low=0)
        if self.n_gpus_per_node and self.n_workers not in (1, self.n_gpus_per_node):
            raise ValueError(
                f"trainer.n_gpus_per_node={self.n_gpus_per_node} sets one worker per GPU; leave trainer.n_workers "
                f"(={self.n_workers}) unset, it counts CPU workers"
            )
        if self.n_gpus_per_node and self.device == "cpu":
            raise ValueError(
                f"trainer.n_gpus_per_node={self.n_gpus_per_node} asks for GPUs but trainer.device='cpu'"
            )
        if self.nnodes > 1 and self.backend != "ray":
            raise ValueError(
                f"trainer.nnodes={self.nnodes} needs trainer.backend=ray (the local backend is one machine)"
            )
        for name in ("val_every", "save_every"):
            check_range("trainer", name, getattr(self, name), low=0)
        check_positive("trainer", "keep_last", self.keep_last)
        check_positive("trainer", "max_skipped_updates_in_a_row", self.max_skipped_updates_in_a_row)
        for logger in self.loggers:
            check_choice("trainer", "loggers", logger, LOGGERS)
