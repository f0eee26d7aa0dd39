"""``DPOTrainer``: offline preference optimization with the torch engine.

Each step takes ``trainer.global_batch_size`` pairs, runs chosen and rejected through the
engine together (one micro-batch per pair at least; with packing the pair's prompt is scored
once for both responses), computes the preference loss from the summed response log-probs
against the reference's, and takes one optimizer step. Reference log-probs are scored once
before training (``reference=precompute``, saved for resume) or each step by a frozen model
(``reference=model``); with LoRA the reference is the base model with the adapter off.

It is the SFT trainer with another data set and step: the engine's worker group (one rank, or
``trainer.n_workers`` data-parallel ranks each taking an equal share of every step's pairs),
checkpoints, exact resume, divergence checks and HF export are shared. It logs TRL's metric names (``loss``,
``rewards/{chosen,rejected,accuracies,margins}``, ``logps/{chosen,rejected}``, ``grad_norm``,
``learning_rate``, and ``eval_*`` for the validation pairs) to ``metrics.jsonl``, and keeps
``run.json``, ``status.json`` and ``report.html`` beside it (docs/report.md).

With ``dataplane.enabled`` the controller keeps each pair's lengths, not its tokens; the
reference's pass and the update get a ``BatchRef`` of per-row scalars (the pairs' file rows among
them) and each rank collates its own rows from the data file (:mod:`tandem.dpo.rank_collation`);
the reference's per-row scores come back inline with the rows (docs/data-plane.md).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import torch
from rich.console import Console

from tandem.dpo.config import DPOConfig
from tandem.dpo.data import PreferenceDataset
from tandem.dpo.loss import pair_metrics, preference_loss, row_summaries, summed_preference_loss
from tandem.dpo.rank_collation import controller_view, pair_collators, preference_rows
from tandem.dpo.worker import PreferenceWorker
from tandem.protocol import Batch
from tandem.run.output_dir import OutputDirLock
from tandem.sft.engine_worker import merged_metrics
from tandem.sft.step_rows import Rows, StepRows, with_fields
from tandem.sft.trainer import SFTTrainer

REFERENCE_FILE = "reference_logps.pt"


@dataclasses.dataclass
class DPOResult:
    """Every logged step's metrics, the last validation metrics, and where the outputs went."""

    history: list[dict[str, float]]
    validation: dict[str, float]
    output_dir: Path
    hf_model_dir: Path
    report: Path | None


class DPOTrainer(SFTTrainer):
    """Runs :class:`DPOConfig` end to end (see the module docstring)."""

    config: DPOConfig
    train: PreferenceDataset
    val: PreferenceDataset | None
    worker_class = PreferenceWorker

    def __init__(self, config: DPOConfig, console: Console | None = None) -> None:
        super().__init__(config, console)  # type: ignore[arg-type]
        self.reference: dict[str, torch.Tensor] = {}  # split -> [pairs, 2] (chosen, rejected)

    def describe(self) -> str:
        """What this run trains, for the console and ``run.json``."""
        loss = self.config.preference
        reference = f", reference {self.config.reference}" if loss.needs_reference else ""
        return f"DPO: {loss.label} loss, beta {loss.beta}{reference}"

    def load_data(self) -> tuple[PreferenceDataset, PreferenceDataset | None]:
        data, keep = self.config.data, not self.config.dataplane.enabled
        val = PreferenceDataset.load(data.val_path, self.tokenizer, data, keep) if data.val_path else None
        return PreferenceDataset.load(data.train_path, self.tokenizer, data, keep), val

    def worker_args(self) -> tuple:
        return (self.engine_config, self.config.ref_model_path, self.rank_collators())

    def rank_collators(self) -> dict:
        if not self.config.dataplane.enabled:
            return {}
        return pair_collators(self.config.data, self.engine_config.model_path, unpaired=False)

    def fit(self) -> DPOResult:  # type: ignore[override]
        """Train for ``total_steps``; the run holds ``trainer.output_dir`` meanwhile."""
        with OutputDirLock(self.output_dir, "trainer.output_dir"), self.started():
            return self._fit()

    def _fit(self) -> DPOResult:  # type: ignore[override]
        trainer = self.config.trainer
        if trainer.resume:
            self._resume()
        self._print_plan()
        if self.config.preference.needs_reference and self.config.reference == "precompute":
            self._precompute_reference()
        record = self.run_loop()
        hf_dir = self.export()
        report = self.report.path if self.report is not None else None
        if report is not None:
            self.console.print(f"report: {report}")
        return DPOResult(record.history, record.validation, self.output_dir, hf_dir, report)

    # ------------------------------------------------------------------ the step
    def train_step(self) -> dict[str, float]:
        """One optimizer step on ``global_batch_size`` pairs; returns its metrics."""
        started = time.perf_counter()
        indices = self.sampler.take(self.config.trainer.global_batch_size)
        with self.step_rows() as step:
            batch, rows = self._with_reference(
                step, *self._pairs(step, self.train, "train", indices), "train"
            )
            chosen_tokens = self._chosen_tokens(batch)
            loss_fn = functools.partial(
                preference_loss,
                config=self.config.preference,
                total_pairs=len(indices),
                chosen_tokens=chosen_tokens,
            )
            reports = self.group.train_step(  # each rank: whole pairs
                rows, loss_fn=loss_fn, with_sum_pi_squared=self.config.preference.use_weighting
            )
            return {
                **self._finish_step(reports, int(batch["tokens"].sum()), started, rows),
                **pair_metrics(merged_metrics(reports), chosen_tokens),
            }

    def validate(self) -> dict[str, float]:
        return self.evaluate_pairs()

    def evaluate_pairs(self) -> dict[str, float]:
        """The validation pairs' loss and metrics (``eval_*``), scored in batches of
        ``global_batch_size`` pairs spread over the workers (the loss itself on the controller,
        from each response's summed log-prob)."""
        assert self.val is not None
        size = self.config.trainer.global_batch_size
        chosen_total = float(sum(chosen for _, chosen, _ in self.val.lengths))  # shares add up to the mean
        loss, sums = 0.0, {}
        for start in range(0, len(self.val), size):
            indices = list(range(start, min(start + size, len(self.val))))
            with self.step_rows() as step:
                batch, rows = self._with_reference(step, *self._pairs(step, self.val, "val", indices), "val")
                part, metrics = summed_preference_loss(
                    batch,
                    self._policy_summaries(step, rows),
                    self.config.preference,
                    total_pairs=len(self.val),
                    chosen_tokens=chosen_total,
                    lengths=batch["response_tokens"],
                )
            loss += float(part)
            for name, value in metrics.items():
                sums.setdefault(name, []).append(float(value))
        return {"eval_loss": loss, **{f"eval_{k}": v for k, v in pair_metrics(sums, chosen_total).items()}}

    @staticmethod
    def _chosen_tokens(batch: Batch) -> float:
        """The chosen responses' token count (RPO's NLL divides by it), at least 1."""
        return max(float((batch["response_tokens"] * batch["chosen"]).sum()), 1.0)

    def _pairs(
        self, step: StepRows, dataset: PreferenceDataset, split: str, indices: list[int]
    ) -> tuple[Batch, Rows]:
        """The pairs ``indices`` as the controller reads them (per-row fields and counts:
        :func:`~tandem.dpo.rank_collation.controller_view`) and as the workers get them: the
        collated ``Batch`` (off), or with ``dataplane.enabled`` file rows each rank collates."""
        if self.config.dataplane.enabled:
            return preference_rows(dataset, split, indices, self.tokenizer.pad_token_id)
        batch = dataset.collate(indices, self.tokenizer.pad_token_id)
        return controller_view(batch), step.put(batch)

    # ------------------------------------------------------------------ the reference
    def _with_reference(self, step: StepRows, batch: Batch, rows: Rows, split: str) -> tuple[Batch, Rows]:
        """``batch`` (the controller's view of the pairs) and the workers' ``rows`` of them, each
        with ``ref_log_prob [2P]``: from the precomputed table, or scored now on the workers' rows."""
        if not self.config.preference.needs_reference:
            return batch, rows
        if self.config.reference == "precompute":
            table = self.reference[split]
            values = table[batch["pair"], 1 - batch["chosen"]]
        else:
            values = self._score_reference(step, rows)
        return batch.assign(tensors={"ref_log_prob": values}), with_fields(rows, {"ref_log_prob": values})

    def _policy_summaries(self, step: StepRows, rows: Rows) -> Batch:
        """Each row's :func:`~tandem.dpo.loss.row_summaries` under the policy, without gradients."""
        loss = self.config.preference
        summarize = functools.partial(row_summaries, ld_alpha=loss.ld_alpha, with_weights=loss.use_weighting)
        return step.output(
            self.group.sequence_scores(rows, summarize=summarize, with_sum_pi_squared=loss.use_weighting)
        )

    def _score_reference(self, step: StepRows, rows: Rows) -> torch.Tensor:
        """Summed response log-probs ``[2P]`` of ``rows`` under the reference (LD-desensitised
        like the policy's with ``ld_alpha``): the base model with LoRA's adapter off, the policy
        itself before its first update, else a frozen copy of ``ref_model_path`` (or
        ``model_path``) on each worker."""
        summarize = functools.partial(
            row_summaries, ld_alpha=self.config.preference.ld_alpha, with_weights=False
        )
        scores = self.group.sequence_scores(rows, reference=True, summarize=summarize)
        return step.output(scores)["score"].float()

    def _precompute_reference(self) -> None:
        """Score every training and validation pair under the reference once (or load the scores
        a previous run of this output directory saved)."""
        path = self.output_dir / REFERENCE_FILE
        sizes = {"train": len(self.train), **({"val": len(self.val)} if self.val is not None else {})}
        ld_alpha = self.config.preference.ld_alpha  # LD-DPO scores the reference as it scores the policy
        if path.exists():
            saved = torch.load(path)
            tables, scored_with = (saved["tables"], saved["ld_alpha"]) if "tables" in saved else (saved, None)
            if {k: v.shape[0] for k, v in tables.items()} == sizes and scored_with == ld_alpha:
                self.reference = tables
                self.console.print(f"reference log-probs loaded from {path}")
                return
            if scored_with != ld_alpha:
                self.console.print(
                    f"{path} was scored with preference.ld_alpha={scored_with}, this run has {ld_alpha}: scoring again"
                )
        started = time.monotonic()
        for split, dataset in (("train", self.train), ("val", self.val)):
            if dataset is None:
                continue
            table = torch.zeros(len(dataset), 2)
            size = self.config.trainer.global_batch_size
            for start in range(0, len(dataset), size):
                indices = list(range(start, min(start + size, len(dataset))))
                with self.step_rows() as step:
                    batch, rows = self._pairs(step, dataset, split, indices)
                    table[batch["pair"], 1 - batch["chosen"]] = self._score_reference(step, rows)
            self.reference[split] = table
        self.output_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"tables": self.reference, "ld_alpha": ld_alpha}, path)
        self.console.print(
            f"reference log-probs of {sum(sizes.values())} pairs in {time.monotonic() - started:.1f} s"
        )

    # ------------------------------------------------------------------ logging
    def console_line(self, step: int, metrics: dict[str, float]) -> str:
        """The console's line for a logged step."""
        line = (
            f"step {step}/{self.total_steps}  loss {metrics['loss']:.4f}  "
            f"accuracy {metrics['rewards/accuracies']:.3f}  margin {metrics['rewards/margins']:.4f}  "
            f"grad_norm {metrics['grad_norm']:.3f}  lr {metrics['learning_rate']:.2e}"
        )
        if "eval_loss" in metrics:
            line += f"  eval_loss {metrics['eval_loss']:.4f}  eval_accuracy {metrics['eval_rewards/accuracies']:.3f}"
        return line

    def _print_plan(self) -> None:
        train = self.train
        self.console.print(
            f"[bold]{self.describe()}[/]; "
            f"{len(train)} pairs ({train.invalid} invalid and {train.overlong} over data.max_length dropped), "
            f"{len(self.val) if self.val is not None else 0} validation pairs; {self.total_steps} steps of "
            f"{self.config.trainer.global_batch_size} pairs, starting at step {self.step}"
        )
