"""``PreferenceWorker``: the SFT trainer's engine rank (:class:`~tandem.sft.engine_worker.EngineWorker`)
declaring the per-row fields of pairs among those it fetches of a ``BatchRef`` (docs/data-plane.md).

Scoring reads what :func:`~tandem.dpo.loss.row_summaries` reads (``loss_mask``; ``pair`` and
``chosen`` for LD-DPO's shared tokens); the update reads the preference losses' inputs too
(``ref_log_prob``, and KTO's ``desirable``). Called with a ``Batch``, both are the engine rank's.
"""

from __future__ import annotations

from tandem.controller import mesh_dispatch, register
from tandem.dpo.rank_collation import RESPONSE_ROW
from tandem.engine.base import LossFn
from tandem.engine.divergence import ModelHealth
from tandem.engine.forward_fields import FORWARD_FIELDS
from tandem.protocol import Batch
from tandem.sft.dataset_rows import ROW_FIELD
from tandem.sft.engine_worker import ENGINE_MESH, SFT_READS, EngineWorker, StepReport, Summarize

PAIR_READS = (*SFT_READS, "pair", "chosen", RESPONSE_ROW)  # response_row: rows collated on the rank
PAIR_UPDATE_READS = (*PAIR_READS, "ref_log_prob", "desirable")


class PreferenceWorker(EngineWorker):
    """One rank of the DPO, KTO and reward-model trainers' group (see the module docstring)."""

    @register(dispatch=mesh_dispatch(ENGINE_MESH), reads=PAIR_UPDATE_READS)
    def train_step(self, batch: Batch, *, loss_fn: LossFn, with_sum_pi_squared: bool = False) -> StepReport:
        """:meth:`EngineWorker.train_step` on this rank's pairs (or unpaired rows)."""
        return super().train_step(batch, loss_fn=loss_fn, with_sum_pi_squared=with_sum_pi_squared)

    @register(dispatch=mesh_dispatch(ENGINE_MESH), reads=PAIR_READS, outputs="ref")
    def sequence_scores(
        self,
        batch: Batch,
        *,
        reference: bool = False,
        summarize: Summarize | None = None,
        with_sum_pi_squared: bool = False,
    ) -> Batch:
        """:meth:`EngineWorker.sequence_scores` of this rank's rows (``[B]`` per row)."""
        return super().sequence_scores(
            batch, reference=reference, summarize=summarize, with_sum_pi_squared=with_sum_pi_squared
        )

    @register(dispatch="ONE_TO_ALL", reads=(*FORWARD_FIELDS, ROW_FIELD, RESPONSE_ROW, "chosen"))
    def health(self, probe: Batch) -> ModelHealth:
        """:meth:`EngineWorker.health`, reading what a probe of pair rows is collated from."""
        return super().health(probe)
