"""``EngineWorker``: one rank of the SFT and DPO trainers' worker group.

The trainers (:mod:`tandem.sft.trainer`, :mod:`tandem.dpo.trainer`) are the controller: they
sample and collate each step's batch and call the group. Each rank holds a
:class:`~tandem.engine.TorchTrainEngine` on its own device (DDP or FSDP2 over the group when
there are several ranks), runs the loss it is handed on its shard of the batch, and steps the
optimizer; the loss divides by the whole batch's counts, so the ranks' shares add up to the
loss of the whole batch however it was split. Scoring calls return each row's summed log-prob
over its ``loss_mask`` tokens (a reward model's score at the last one), from which the
controller computes evaluation losses and the DPO reference.

With ``dataplane.enabled`` the trainers pass a :class:`~tandem.dataplane.BatchRef` instead
(:mod:`tandem.sft.step_rows`): each rank fetches only the fields its method declares
(``@register(reads=...)``: ``SFT_READS``, the engine's forward fields and ``loss_mask``) of
only its rows, and the scores come back as a ``BatchRef`` (``outputs="ref"``; a per-row score
is held inline). Rows sent as ``dataset_row`` numbers (:mod:`tandem.sft.dataset_rows`) are read,
tokenised and collated here, from the data file, before the method runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from tandem.controller import Worker, mesh_dispatch, register
from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.engine.base import LossFn, TokenOutputs
from tandem.engine.divergence import ModelHealth
from tandem.engine.forward_fields import FORWARD_FIELDS
from tandem.engine.on_rank import EngineCheckpoints, bind_rank, frozen_copy, start_engine
from tandem.models.loading import load_tokenizer
from tandem.protocol import Batch
from tandem.sft.dataset_rows import ROW_FIELD, CollatorFactory, RankRows

Summarize = Callable[[Batch, TokenOutputs], Batch]  # rows and their outputs -> per-row values [B]


def summed_log_probs(batch: Batch, outputs: TokenOutputs) -> Batch:
    """``score [B]``: each row's log-prob summed over its ``loss_mask`` tokens (a reward model:
    its score at the last one)."""
    return Batch({"score": outputs.sequence_summary(batch["loss_mask"])})


ENGINE_MESH = "engine"  # the engine's data-parallel ranks: sequence/tensor-parallel peers get the same rows
# what a rank fetches of a BatchRef (docs/data-plane.md); dataset_row: rows it collates itself
SFT_READS = (*FORWARD_FIELDS, "loss_mask", ROW_FIELD)


@dataclass
class StepReport:
    """One rank's part of an optimizer step: its loss share, its micro-batches' metrics, the
    global gradient norm (the same on every rank), the learning rate the step used, and
    whether the update was skipped (agreed over the ranks)."""

    loss: float
    metrics: dict[str, list[float]]
    grad_norm: float
    learning_rate: float
    skipped: bool


class EngineWorker(EngineCheckpoints, Worker):
    """One rank of the engine group (see the module docstring); its checkpoints are the engine's
    (:class:`~tandem.engine.on_rank.EngineCheckpoints`).

    Args:
        engine: the policy's engine settings; ``strategy=single`` becomes DDP on several ranks.
        reference_path: the frozen model :meth:`sequence_scores` scores with as the reference
            when it is not the policy itself (empty: the policy's starting weights).
        dataset_rows: per split, the factory of the collator this rank rebuilds rows named by
            ``dataset_row`` with (:mod:`tandem.sft.dataset_rows`; empty: it is always sent them).
    """

    def __init__(
        self,
        engine: EngineConfig,
        reference_path: str = "",
        dataset_rows: dict[str, CollatorFactory] | None = None,
    ) -> None:
        self.engine_config = engine
        self.reference_path = reference_path
        self.dataset_rows = RankRows(dataset_rows or {})

    @register(dispatch="ONE_TO_ALL")
    def init_engine(self) -> int:
        """Bind this rank's device, join the group's process group, load the model; returns the
        embedding table's row count (the vocabulary the tokenizer must fit in)."""
        device = bind_rank(self, self.engine_config.device)
        engine_config = dataclasses.replace(self.engine_config, device=str(device))
        self.engine = start_engine(self, engine_config, mesh=ENGINE_MESH)
        self.reference_engine: TorchTrainEngine | None = None
        return int(self.engine.causal_lm.get_input_embeddings().weight.shape[0])

    @register(dispatch=mesh_dispatch(ENGINE_MESH), reads=SFT_READS)
    def train_step(self, batch: Batch, *, loss_fn: LossFn, with_sum_pi_squared: bool = False) -> StepReport:
        """Forward/backward of ``loss_fn`` on this rank's shard, then one optimizer step (skipped
        on every rank when any rank's loss or the gradient norm is not finite) and one
        learning-rate step. ``with_sum_pi_squared``: the outputs ``loss_fn`` sees carry
        ``sum_pi_squared`` (WPO's weights)."""
        batch = self.dataset_rows.collated(batch)
        result = self.engine.forward_backward(batch, loss_fn, with_sum_pi_squared=with_sum_pi_squared)
        learning_rate = self.engine.lr
        grad_norm = self.engine.optimizer_step(skip=not math.isfinite(result.loss))
        self.engine.lr_step()
        return StepReport(
            result.loss, result.metrics, grad_norm, learning_rate, self.engine.last_step_skipped
        )

    @register(dispatch=mesh_dispatch(ENGINE_MESH), reads=SFT_READS, outputs="ref")
    def sequence_scores(
        self,
        batch: Batch,
        *,
        reference: bool = False,
        summarize: Summarize | None = None,
        with_sum_pi_squared: bool = False,
    ) -> Batch:
        """``score [B]``: each row's log-prob summed over its ``loss_mask`` tokens (a reward
        model: its score at the last one), or whatever ``summarize(batch, outputs)`` returns
        per row (the DPO trainer's LD-DPO sums and WPO weights; ``with_sum_pi_squared`` gives it
        ``outputs.sum_pi_squared``), under the policy or (``reference``) the reference: the base
        model with LoRA's adapter off, the policy itself before its first update, else a frozen
        copy loaded once."""
        summarize = summarize or summed_log_probs
        batch = self.dataset_rows.collated(batch)
        if not reference:
            engine = self.engine
        elif self.engine_config.lora.rank:
            with self.engine.adapter_disabled():
                return self._summed(self.engine, batch, summarize, with_sum_pi_squared)
        elif self.engine.step_count == 0 and not self.reference_path:
            engine = self.engine
        else:
            engine = self._reference_engine()
        return self._summed(engine, batch, summarize, with_sum_pi_squared)

    def _summed(
        self, engine: TorchTrainEngine, batch: Batch, summarize: Summarize, with_sum_pi_squared: bool
    ) -> Batch:
        outputs = engine.forward_backward(
            batch, None, forward_only=True, with_sum_pi_squared=with_sum_pi_squared
        ).outputs
        return summarize(batch, outputs)

    def _reference_engine(self) -> TorchTrainEngine:
        if self.reference_engine is None:  # a full frozen copy per rank: forward only, no collectives
            config = self.engine_config
            self.reference_engine = frozen_copy(
                dataclasses.replace(
                    config,
                    model_path=self.reference_path or config.model_path,
                    device=str(self.engine.device),
                    strategy="single",
                    lr_schedule="constant",
                )
            )
        return self.reference_engine

    @register(dispatch="ONE_TO_ALL", reads=(*FORWARD_FIELDS, ROW_FIELD))
    def health(self, probe: Batch) -> ModelHealth:
        """This rank's weights and the log-probs of ``probe`` (a row or two): finite or not."""
        return self.engine.health(self.dataset_rows.collated(probe))

    @register(dispatch="ONE_TO_ALL")
    def export_hf(self, path: str) -> None:
        """The current policy (LoRA merged) with the tokenizer of ``engine.model_path`` as a plain
        HF model directory; every rank joins the gather (FSDP2), rank 0 writes."""
        self.engine.export_hf(path, load_tokenizer(self.engine_config.model_path), write=self.rank == 0)


def total_loss(reports: list[StepReport]) -> float:
    """The step's loss: the ranks' shares add up."""
    return sum(report.loss for report in reports)


def merged_metrics(reports: list[StepReport]) -> dict[str, list[float]]:
    """Every rank's micro-batch metrics, as one list per name."""
    merged: dict[str, list[float]] = {}
    for report in reports:
        for name, values in report.metrics.items():
            merged.setdefault(name, []).extend(values)
    return merged
