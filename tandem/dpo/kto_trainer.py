"""``KTOTrainer``: preference optimization on unpaired rows (``preference.name=kto`` or
``apo_zero_unpaired`` in ``tandem dpo``).

It is the DPO trainer with unpaired data (:mod:`tandem.dpo.unpaired`) and another step. Each
step takes ``trainer.global_batch_size`` rows; first the policy (without gradients) and the
reference score each row's mismatched completion, and their mean log-ratio, clamped at 0, is
the step's reference point ``kl``; then the rows' own completions train with the KTO loss
against it. The reference is precomputed or scored each step, as in DPO. It logs TRL's KTO
metric names: ``loss``, ``kl``, ``rewards/{chosen,rejected,margins}``, ``logps/{chosen,rejected}``
(chosen: desirable rows, rejected: undesirable ones), and ``eval_*`` for the validation rows.
"""

from __future__ import annotations

import functools
import time

import torch

from tandem.algos.preference import KL_BASELINE, kto_kl_estimate
from tandem.dpo.rank_collation import pair_collators
from tandem.dpo.trainer import DPOTrainer
from tandem.dpo.unpaired import UnpairedDataset
from tandem.dpo.unpaired_loss import summed_unpaired_loss, unpaired_loss, unpaired_metrics
from tandem.sft.engine_worker import merged_metrics
from tandem.sft.step_rows import Rows, StepRows


class KTOTrainer(DPOTrainer):
    """Runs a :class:`~tandem.dpo.DPOConfig` whose ``preference`` loss is unpaired (see the module docstring)."""

    train: UnpairedDataset
    val: UnpairedDataset | None

    def describe(self) -> str:
        loss = self.config.preference
        return (
            f"KTO: {loss.name} loss, beta {loss.beta}, desirable weight {loss.desirable_weight}, "
            f"undesirable weight {loss.undesirable_weight}, reference {self.config.reference}"
        )

    def load_data(self) -> tuple[UnpairedDataset, UnpairedDataset | None]:  # type: ignore[override]
        data, keep = self.config.data, not self.config.dataplane.enabled
        val = UnpairedDataset.load(data.val_path, self.tokenizer, data, keep) if data.val_path else None
        return UnpairedDataset.load(data.train_path, self.tokenizer, data, keep), val

    def rank_collators(self) -> dict:
        if not self.config.dataplane.enabled:
            return {}
        return pair_collators(self.config.data, self.engine_config.model_path, unpaired=True)

    def _split(self, rows: Rows) -> tuple[Rows, Rows]:
        """The rows with their own completions and the rows with the mismatched ones."""
        own = rows["chosen"].bool()
        return rows[own.nonzero().flatten()], rows[(~own).nonzero().flatten()]

    def _kl(self, step: StepRows, mismatched: Rows) -> torch.Tensor:
        """The reference point from the mismatched rows (scored by the policy only when the loss reads it)."""
        if self.config.preference.name not in KL_BASELINE:
            return torch.zeros(())
        policy = step.output(self.group.sequence_scores(mismatched))["score"]
        return kto_kl_estimate(policy.float(), mismatched["ref_log_prob"].float())

    def train_step(self) -> dict[str, float]:
        """One optimizer step on ``global_batch_size`` rows; returns its metrics."""
        started = time.perf_counter()
        indices = self.sampler.take(self.config.trainer.global_batch_size)
        with self.step_rows() as step:
            batch, rows = self._with_reference(
                step, *self._pairs(step, self.train, "train", indices), "train"
            )
            own, mismatched = self._split(rows)
            kl = self._kl(step, mismatched)
            loss_fn = functools.partial(
                unpaired_loss, config=self.config.preference, total_rows=len(indices), kl=kl
            )
            reports = self.group.train_step(own, loss_fn=loss_fn)
            return {
                **self._finish_step(reports, int(self._split(batch)[0]["tokens"].sum()), started, own),
                **unpaired_metrics(merged_metrics(reports)),
                "kl": float(kl),
            }

    def evaluate_pairs(self) -> dict[str, float]:
        """The validation rows' loss and metrics (``eval_*``) in batches of ``global_batch_size``
        rows, each batch with its own reference point as in training."""
        assert self.val is not None
        size = self.config.trainer.global_batch_size
        loss, sums, kls = 0.0, {}, []
        for start in range(0, len(self.val), size):
            indices = list(range(start, min(start + size, len(self.val))))
            with self.step_rows() as step:
                batch, rows = self._with_reference(step, *self._pairs(step, self.val, "val", indices), "val")
                own, mismatched = self._split(rows)
                kl = self._kl(step, mismatched)
                scores = step.output(self.group.sequence_scores(own))["score"]
                part, metrics = summed_unpaired_loss(
                    self._split(batch)[0], scores, self.config.preference, len(self.val), kl
                )
            loss += float(part)
            kls.append(float(kl) * len(indices))
            for name, value in metrics.items():
                sums.setdefault(name, []).append(float(value))
        metrics = {"loss": loss, "kl": sum(kls) / len(self.val), **unpaired_metrics(sums)}
        return {f"eval_{name}": value for name, value in metrics.items()}

    def console_line(self, step: int, metrics: dict[str, float]) -> str:
        line = (
            f"step {step}/{self.total_steps}  loss {metrics['loss']:.4f}  kl {metrics['kl']:.4f}  "
            f"margin {metrics.get('rewards/margins', float('nan')):.4f}  grad_norm {metrics['grad_norm']:.3f}  "
            f"lr {metrics['learning_rate']:.2e}"
        )
        if "eval_loss" in metrics:
            line += f"  eval_loss {metrics['eval_loss']:.4f}"
        return line

    def _print_plan(self) -> None:
        train = self.train
        self.console.print(
            f"[bold]{self.describe()}[/]; {len(train)} rows ({sum(train.desirable)} desirable; {train.invalid} "
            f"invalid and {train.overlong} over data.max_length dropped), "
            f"{len(self.val) if self.val is not None else 0} validation rows; {self.total_steps} steps of "
            f"{self.config.trainer.global_batch_size} rows, starting at step {self.step}"
        )
