"""The SFT loop: sample conversations, one optimizer step per global batch, evaluate, checkpoint, export.

The trainer is the controller; the engine runs in a worker group of ``trainer.n_workers``
ranks (or one per GPU), each taking an equal share of every batch (:mod:`tandem.sft.engine_worker`).
With ``dataplane.enabled`` the controller sends each step's rows as row numbers of the data file
and each rank collates its own rows there (:mod:`tandem.sft.dataset_rows`, docs/data-plane.md):
the controller holds per-row counts, never a ``[B, S]`` tensor.
Every step's metrics (``loss``, ``grad_norm``, ``learning_rate``, ``eval_loss`` when it
evaluates, throughput) go to ``metrics.jsonl``, with ``run.json``, ``status.json`` and
``report.html`` beside it (docs/report.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from tandem.algos.aggregation import LossNormalizer
from tandem.config.paths import check_workers_share_output_dir, with_absolute_paths
from tandem.controller import WorkerGroup, check_placement, create_worker_group
from tandem.engine.divergence import SkippedUpdates, check_health
from tandem.models.gguf import with_gguf_resolved
from tandem.models.loading import check_vocab_fits, load_tokenizer
from tandem.models.vision import ImagePrompter
from tandem.report import RunInfo
from tandem.report.tracker import ReportTracker
from tandem.run.checkpoints import CheckpointManager
from tandem.run.loop import EveryNthStep, RunRecord, Schedule, recording, run_steps
from tandem.run.output_dir import OutputDirLock, check_output_dir
from tandem.run.sampler import EpochSampler
from tandem.run.trackers import JsonlTracker
from tandem.sft.config import SFTConfig
from tandem.sft.data import SFTDataset
from tandem.sft.engine_worker import EngineWorker, StepReport, total_loss
from tandem.sft.loss import sft_loss
from tandem.sft.rank_collation import RowCounts, sft_collators, sft_rows
from tandem.sft.step_rows import Rows, StepRows, step_rows


@dataclasses.dataclass
class SFTResult:
    """Per-step training losses, the evaluation losses by step, and where the final model went."""

    train_losses: list[float]
    eval_losses: dict[int, float]
    hf_model_dir: Path


class SFTTrainer:
    """Supervised fine-tuning of a causal LM on chat data with the torch engine.

    :class:`tandem.dpo.DPOTrainer` builds on it: the worker group, checkpoints, resume,
    divergence checks and export are shared; the data and the step differ."""

    worker_class: type[EngineWorker] = EngineWorker  # a subclass, built with worker_args(), may extend a rank

    def __init__(self, config: SFTConfig, console: Console | None = None) -> None:
        config = with_absolute_paths(config)  # its path fields: workers may run in another directory (Ray)
        config = with_gguf_resolved(config)  # a GGUF model converted once, before the workers
        self.config = config
        self.console = console or Console()
        self.output_dir = check_output_dir(config.trainer.output_dir, "trainer.output_dir")
        model_path = config.engine.model_path or config.model_path
        self.engine_config = dataclasses.replace(config.engine, model_path=model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.train, self.val = self.load_data()
        steps_per_epoch = -(-len(self.train) // config.trainer.global_batch_size)
        self.total_steps = config.trainer.total_steps or steps_per_epoch * config.trainer.epochs
        if self.engine_config.lr_schedule != "constant" and self.engine_config.total_steps == 0:
            self.engine_config = dataclasses.replace(self.engine_config, total_steps=self.total_steps)
        self.workers: WorkerGroup | None = None  # the engine group, while started()
        self.sampler = EpochSampler(len(self.train), config.trainer.seed)
        self.skipped = SkippedUpdates(
            config.trainer.max_skipped_updates_in_a_row, "trainer.max_skipped_updates_in_a_row"
        )
        self.step = 0
        self.checkpoints = CheckpointManager(self.output_dir / "checkpoints", config.trainer.keep_last)
        self.run_info = RunInfo(
            self.output_dir,
            trainer=self.describe(),
            experiment=config.trainer.experiment,
            project=config.trainer.project,
            config=dataclasses.asdict(config),
            model_path=self.engine_config.model_path,
            data_files={"train": config.data.train_path, "val": config.data.val_path},
            total_steps=self.total_steps,
        )
        self.report: ReportTracker | None = None
        self.record: RunRecord | None = None  # what the run logged, once it runs

    def describe(self) -> str:
        """What this run trains, for the console and ``run.json``."""
        return "SFT"

    def load_data(self) -> tuple[SFTDataset, SFTDataset | None]:
        """The training and (when ``data.val_path`` is set) validation sets."""
        data = self.config.data
        prompter = ImagePrompter.for_model(self.engine_config.model_path, data.min_pixels, data.max_pixels)
        keep = (
            not self.config.dataplane.enabled
        )  # on: the ranks tokenise their rows; the controller keeps counts
        val = SFTDataset.load(data.val_path, self.tokenizer, data, prompter, keep) if data.val_path else None
        return SFTDataset.load(data.train_path, self.tokenizer, data, prompter, keep), val

    def fit(self) -> SFTResult:
        """Train for ``total_steps``; returns the losses and the exported model directory.

        The run holds ``trainer.output_dir`` for its duration: a second run there is refused.
        """
        with OutputDirLock(self.output_dir, "trainer.output_dir"), self.started():
            return self._fit()

    @contextlib.contextmanager
    def started(self) -> Iterator[WorkerGroup]:
        """The engine's worker group, its models loaded, for the duration; shut down after."""
        trainer = self.config.trainer
        pool = trainer.resource_pool()
        check_placement(
            [pool],
            trainer.backend,
            "trainer.n_gpus_per_node or trainer.n_workers",
            device=("engine.device", self.config.engine.device),
        )
        with create_worker_group(self.worker_class, pool, trainer.backend, args=self.worker_args()) as group:
            check_workers_share_output_dir(group, self.output_dir)
            check_vocab_fits(group.init_engine()[0], self.tokenizer)
            if self.config.dataplane.enabled:
                group.use_data_store(self.config.dataplane)  # where the ranks keep their outputs
            self.workers = group
            try:
                yield group
            finally:
                self.workers = None

    def worker_args(self) -> tuple:
        """What each :class:`EngineWorker` is built with."""
        return (self.engine_config, "", self.rank_collators())

    def rank_collators(self) -> dict:
        """Per split, what a rank collates its rows with (``dataplane.enabled``; else none)."""
        if not self.config.dataplane.enabled:
            return {}
        return sft_collators(self.config.data, self.engine_config.model_path)

    @property
    def group(self) -> WorkerGroup:
        if self.workers is None:
            raise RuntimeError("the trainer's workers are not running; call it inside trainer.started()")
        return self.workers

    def step_rows(self) -> contextlib.AbstractContextManager[StepRows]:
        """What one step's worker calls get: its ``Batch``, or with ``dataplane.enabled`` a
        ``BatchRef`` of per-row scalars the ranks collate from, every block released when the
        step ends (:mod:`tandem.sft.step_rows`)."""
        return step_rows(self.config.dataplane, self.group)

    def trackers(self) -> list:
        """``metrics.jsonl``, the report unless ``trainer.report`` is off, and a console line every
        ``trainer.log_every`` steps."""
        trainer = self.config.trainer
        trackers: list = [JsonlTracker(self.output_dir / "metrics.jsonl", self.step if self.step else None)]
        self.report = ReportTracker(self.output_dir, trainer.report_every) if trainer.report else None
        if self.report is not None:
            trackers.append(self.report)
        trackers.append(
            EveryNthStep(self.console, trainer.log_every, self.total_steps, "eval_loss", self.console_line)
        )
        return trackers

    def run_loop(self) -> RunRecord:
        """Step, evaluate and checkpoint on schedule (evaluation and a checkpoint at the end too),
        inside ``status.json``'s running / finished / failed bracket; what it logged."""
        trainer = self.config.trainer
        schedule = Schedule(
            total_steps=self.total_steps,
            validate_every=trainer.eval_every,
            save_every=trainer.save_every,
            validates=self.val is not None,
        )
        with recording(self.run_info, self.trackers(), self.step, self.console) as self.record:
            run_steps(self, schedule, self.record)
        return self.record

    def _fit(self) -> SFTResult:
        trainer = self.config.trainer
        if trainer.resume:
            self._resume()
        self.console.print(
            f"[bold]SFT[/] {len(self.train)} conversations ({self.train.dropped} dropped as too long), "
            f"{self.total_steps} steps of {trainer.global_batch_size}, starting at step {self.step}"
        )
        history = self.run_loop().history
        eval_losses = {entry["step"]: entry["eval_loss"] for entry in history if "eval_loss" in entry}
        return SFTResult([entry["loss"] for entry in history], eval_losses, self.export())

    def train_step(self) -> dict[str, float]:
        """One optimizer step on ``global_batch_size`` conversations; returns its metrics."""
        started = time.perf_counter()
        indices = self.sampler.take(self.config.trainer.global_batch_size)
        with self.step_rows() as step:
            rows, counts = self.sft_rows(step, self.train, "train", indices)
            loss_tokens = counts.loss_tokens
            normalizer = LossNormalizer(float(loss_tokens.sum()), float((loss_tokens > 0).sum()))
            reports = self.group.train_step(rows, loss_fn=functools.partial(sft_loss, normalizer=normalizer))
            return self._finish_step(reports, int(counts.tokens.sum()), started, rows)

    def sft_rows(
        self, step: StepRows, dataset: SFTDataset, split: str, indices: list[int]
    ) -> tuple[Rows, RowCounts]:
        """The workers' rows ``indices`` of ``dataset`` and their token counts: the collated
        ``Batch`` (off), or with ``dataplane.enabled`` row numbers each rank collates itself."""
        if self.config.dataplane.enabled:
            return sft_rows(dataset, split, indices, self.tokenizer.pad_token_id)
        batch = dataset.collate(indices, self.tokenizer.pad_token_id)
        return step.put(batch), RowCounts.of(batch)

    def _finish_step(
        self, reports: list[StepReport], tokens: int, started: float, rows: Rows
    ) -> dict[str, float]:
        """Count the step, check it for divergence (probing the first pair of ``rows``), and return
        the metrics every step has: loss, gradient norm, learning rate, time, throughput of the
        step's ``tokens``."""
        self.step += 1
        self._check_divergence(reports[0].skipped, rows[:2])
        seconds = time.perf_counter() - started
        return {
            "loss": total_loss(reports),
            "grad_norm": reports[0].grad_norm,
            "learning_rate": reports[0].learning_rate,
            "timing_s/step": seconds,
            "perf/throughput": tokens / seconds,
            "epoch": float(self.sampler.epoch),
        }

    def validate(self) -> dict[str, float]:
        """The validation metrics logged with a step: ``eval_loss``."""
        return {"eval_loss": self.evaluate()}

    def console_line(self, step: int, metrics: dict[str, float]) -> str:
        """The console's line for a logged step."""
        line = (
            f"step {step}/{self.total_steps}  loss {metrics['loss']:.4f}  grad_norm {metrics['grad_norm']:.3f}  "
            f"lr {metrics['learning_rate']:.2e}  {metrics['perf/throughput']:,.0f} tok/s"
        )
        return line + (f"  eval_loss {metrics['eval_loss']:.4f}" if "eval_loss" in metrics else "")

    def _check_divergence(self, skipped: bool, probe: Rows) -> None:
        """Count a skipped step; stop (naming the step) after too many in a row, or when the
        weights or ``probe``'s log-probs are no longer finite, before anything is saved."""
        self.skipped.record(skipped)
        if skipped:
            self.console.print(f"[yellow]step {self.step}: loss or gradient norm not finite; update skipped")
        self.skipped.check(self.step)
        check_health(self.group.health(probe), self.step, self.checkpoints.latest)

    def evaluate(self) -> float:
        """Mean assistant-token NLL over the whole validation set."""
        assert self.val is not None
        with self.step_rows() as step:
            rows, counts = self.sft_rows(step, self.val, "val", list(range(len(self.val))))
            summed = step.output(self.group.sequence_scores(rows))["score"]
        return float(-summed.sum() / counts.loss_tokens.sum())

    def save_checkpoint(self) -> Path:
        """Engine state (``engine/``) plus the trainer's step and sampler position, under
        ``checkpoints/global_step_<n>`` (:class:`~tandem.run.checkpoints.CheckpointManager`)."""
        state = {"step": self.step, "sampler": self.sampler.state()}
        return self.checkpoints.save(
            self.step, state, lambda path: self.group.save_checkpoint(str(path / "engine"))
        )

    def _resume(self) -> None:
        latest = self.checkpoints.resume_point(
            lambda message: self.console.print(f"[yellow]warning: {escape(message)}", highlight=False)
        )
        if latest is None:
            self.console.print(f"no checkpoint in {self.output_dir}; starting fresh")
            return
        self.group.load_checkpoint(str((latest / "engine").resolve()))
        state = CheckpointManager.read_state(latest)
        self.step = state["step"]
        self.sampler.load_state(state["sampler"])
        self.console.print(f"resumed from {latest}")

    def export(self) -> Path:
        """Save the trained model (LoRA merged) and tokenizer as a plain HF directory."""
        target = self.output_dir / "hf_model"
        self.group.export_hf(str(target.resolve()))
        return target
