"""GKD's dataset steps on the actor's ranks (``algorithm.distill.lmbda < 1``; a mixin of
:class:`tandem.rl.worker.ActorRolloutRefWorker`): with the data plane on, a step on the dataset's
responses is built where it is read and its rollout log-probs are made where its old ones live,
so no per-token field of it passes through the controller (:mod:`tandem.rl.dataset_responses`,
:mod:`tandem.rl.stages.dataset_steps`)."""

from __future__ import annotations

from tandem.controller import register
from tandem.dataplane import BatchRef
from tandem.pipeline.stored_rollout import store_rollout
from tandem.protocol import Batch
from tandem.rl.dataset_responses import dataset_completions, dataset_rows


class DatasetStepRanks:
    """The two rank-side pieces of a dataset step (needs the worker's ``tokenizer`` and store)."""

    @register(dispatch="DP_COMPUTE")
    def dataset_rows_to_store(
        self, rows: Batch, *, response_key: str, max_response_length: int, version: int, prompt_width: int
    ) -> BatchRef:
        """This rank's ``rows`` (requests: ``prompt_ids`` and the row columns) completed with their
        own responses (``extra_info[response_key]``, tokenised here, weight version ``version``),
        padded to ``(prompt_width, max_response_length)`` as a generation is, kept in this rank's
        store; back, a ``BatchRef`` with the per-row scalars and texts, as ``generate_to_store``'s."""
        tokenizer = self.tokenizer  # type: ignore[attr-defined]
        completions = dataset_completions(rows, tokenizer, response_key, max_response_length, version)
        batch = dataset_rows(rows, completions, tokenizer.pad_token_id, (prompt_width, max_response_length))
        return store_rollout(batch, self._tandem_data_store(), tokenizer)  # type: ignore[attr-defined]

    @register(dispatch="DP_COMPUTE", reads=("old_log_probs",), outputs="ref")
    def rollout_log_probs_from_old(self, batch: Batch) -> Batch:
        """``rollout_log_probs [B, R]``: the rows' ``old_log_probs`` (a dataset step's responses were
        sampled by no rollout; the policy's own log-probs stand for the behaviour policy's)."""
        return Batch({"rollout_log_probs": batch["old_log_probs"]})
