"""Where step metrics go: console (rich progress bar), a JSONL file, TensorBoard, wandb, MLflow.

Each tracker has ``log(metrics, step)`` and ``close()``; ``build_trackers`` makes the ones named
in ``trainer.loggers``. The JSONL file is the run's record (the report is drawn from it); on
resume, lines of steps after the checkpoint are dropped so the file reads like one run.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("response_length/mean", "len"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/entropy", "entropy"),
    ("actor/grad_norm", "grad"),
    ("rollout_corr/kl", "mismatch_kl"),
    ("timing_s/step", "s/step"),
)


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class ConsoleTracker:
    """A progress bar over the steps and one line of key metrics per step (validation lines in bold)."""

    def __init__(self, total_steps: int, console: Console | None = None, start_step: int = 0) -> None:
        self.console = console or Console()
        self.progress = Progress(
            TextColumn("[bold]RL[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        self.task = self.progress.add_task("steps", total=total_steps, completed=start_step)
        self.progress.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        parts = [f"{label} {metrics[key]:.4g}" for key, label in CONSOLE_KEYS if key in metrics]
        validation = [
            f"{k.removeprefix('val-core/')} {v:.3f}" for k, v in metrics.items() if k.startswith("val-core/")
        ]
        if parts:
            self.console.print(f"step {step}  " + "  ".join(parts))
            self.progress.update(self.task, completed=step)
        if validation:
            self.console.print(f"[bold]step {step}  validation  " + "  ".join(validation))

    def close(self) -> None:
        self.progress.stop()


class JsonlTracker:
    """One JSON object per ``log`` call (``{"step": ..., **metrics}``) appended to ``path``."""

    def __init__(self, path: str | Path, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():  # keep the history up to the checkpoint, drop what came after it
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if line and json.loads(line)["step"] <= resume_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.file = self.path.open("a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_jsonl(path: str | Path) -> list[dict]:
    """The records a :class:`JsonlTracker` wrote."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


class TensorBoardTracker:
    """Scalars to a TensorBoard event file under ``log_dir`` (needs the ``tensorboard`` package)."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(
                "trainer.loggers has 'tensorboard'; install it: pip install tensorboard"
            ) from error
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """Weights & Biases (``pip install wandb``; ``WANDB_MODE=offline`` works without a network)."""

    def __init__(self, project: str, experiment: str, config: dict, directory: str | Path) -> None:
        try:
            import wandb
        except ImportError as error:
            raise ImportError("trainer.loggers has 'wandb'; install it: pip install wandb") from error
        self.run = wandb.init(project=project, name=experiment, config=config, dir=str(directory))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_name(name: str) -> str:
    """``name`` as MLflow accepts it for a metric or a parameter: ``@`` becomes ``_at_`` and every
    other character outside letters, digits, ``_ - . / :`` and space becomes ``_``; an empty,
    ``.`` or ``..`` path segment becomes ``_`` (MLflow refuses names that a file path would
    normalise to something else). Without this, one reward field named ``a|b`` stops the run.
    Two names that differ only in such characters share one MLflow name (the last value wins)."""
    name = re.sub(r"[^\w\-. /:]", "_", name.replace("@", "_at_"))
    return "/".join("_" if part in ("", ".", "..") else part for part in name.split("/"))


class MLflowTracker:
    """MLflow (``pip install mlflow``, or the lighter ``mlflow-skinny``). The store comes from
    ``MLFLOW_TRACKING_URI`` (a server URL, ``sqlite:///mlflow.db`` with the full ``mlflow``
    package, or ``file:./mlruns`` with ``MLFLOW_ALLOW_FILE_STORE=true`` on MLflow 3); unset, MLflow
    picks its own default (``./mlruns`` before MLflow 3, ``sqlite:///mlflow.db`` from 3 on).
    Metric and parameter names are renamed as :func:`mlflow_name` says."""

    def __init__(self, experiment: str, run_name: str, config: dict) -> None:
        try:
            import mlflow
        except ImportError as error:
            raise ImportError("trainer.loggers has 'mlflow'; install it: pip install mlflow") from error
        self.mlflow = mlflow
        mlflow.set_experiment(experiment)
        mlflow.start_run(run_name=run_name)
        mlflow.log_params({mlflow_name(k): str(v)[:500] for k, v in config.items()})

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({mlflow_name(k): v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def build_trackers(
    loggers: tuple[str, ...],
    output_dir: Path,
    total_steps: int,
    start_step: int,
    resumed: bool,
    project: str,
    experiment: str,
    flat_config: dict,
    console: Console | None = None,
) -> list[Tracker]:
    """The trackers named in ``loggers``, writing under ``output_dir``."""
    trackers: list[Tracker] = []
    for name in loggers:
        if name == "console":
            trackers.append(ConsoleTracker(total_steps, console, start_step))
        elif name == "jsonl":
            trackers.append(JsonlTracker(output_dir / "metrics.jsonl", start_step if resumed else None))
        elif name == "tensorboard":
            trackers.append(TensorBoardTracker(output_dir / "tensorboard"))
        elif name == "wandb":
            trackers.append(WandbTracker(project, experiment, flat_config, output_dir))
        elif name == "mlflow":
            trackers.append(MLflowTracker(project, experiment, flat_config))
    return trackers
