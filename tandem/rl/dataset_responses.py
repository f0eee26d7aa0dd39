"""GKD's off-policy steps: the dataset's responses in place of the student's samples.

With ``algorithm.distill.lmbda < 1`` a step is on-policy (the student samples, as in any RL
step) with probability ``lmbda``; otherwise its batch holds the training rows' own responses
(``extra_info[algorithm.distill.response_key]``, e.g. a GSM8K row's worked answer), and the
distillation loss (``jsd``; ``beta=0`` is the forward ``KL(p_t || p_s)`` of classic
knowledge distillation) matches the student to the teacher on those tokens. Which steps are
off-policy follows from the run's seed and the step alone, so a resumed run makes the same
choices.

:class:`DatasetResponseMix` wraps the run's batch source: an on-policy step asks the inner
source; an off-policy one takes the next prompts from the same sampler (the run sees its
prompts in the same order either way) and builds the rows from their responses: the text
tokenised without special tokens, then EOS, cut to ``rollout.max_response_length``. A
response has no rollout log-probs: the trainer computes the student's log-probs of it and
uses them as both (:data:`OFF_POLICY`; :mod:`tandem.rl.stages.dataset_steps`). With the data
plane the rows are built on the ranks that read them (:class:`DatasetResponseMix`).
"""

from __future__ import annotations

import random
from typing import Any

from tandem.dataplane import BatchRef
from tandem.pipeline.requests import with_completions
from tandem.pipeline.source import StepShape
from tandem.pipeline.stored_rollout import trim_stored
from tandem.protocol import Batch
from tandem.protocol.generation import Completion
from tandem.protocol.sequences import trim_padding
from tandem.seeds import derive_seed

OFF_POLICY = "off_policy"  # a non-tensor column: True on rows built from the dataset's responses
OFF_POLICY_SEED_TAG = 9_191_919  # derive_seed(run seed, this, step): the step's draw of lmbda


def is_off_policy_step(seed: int, step: int, lmbda: float) -> bool:
    """Whether ``step`` trains on the dataset's responses: a uniform draw from ``(seed, step)`` is
    at least ``lmbda`` (``lmbda=1``: never; ``lmbda=0``: always)."""
    return random.Random(derive_seed(seed, OFF_POLICY_SEED_TAG, step)).random() >= lmbda


def _tagged(batch: Batch | BatchRef, off_policy: bool) -> Batch | BatchRef:
    """``batch`` with its rows marked (``OFF_POLICY``, inline)."""
    if isinstance(batch, BatchRef):
        return BatchRef(_tagged(batch.scalars, off_policy), batch.parts, batch.schema)
    return batch.assign(non_tensors={OFF_POLICY: [off_policy] * len(batch)})


def response_text(extra_info: dict, key: str, index: int) -> str:
    """Training prompt ``index``'s response (``extra_info[key]``); ``ValueError`` naming the prompt
    when it has none."""
    value = (extra_info or {}).get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"training prompt {index} (counting the prompts kept, in file order) has no response in "
            f"extra_info[{key!r}] (got {value!r}): with algorithm.distill.lmbda < 1 every training row "
            f"needs one (algorithm.distill.response_key)"
        )
    return value


def dataset_completions(
    rows: Batch, tokenizer: Any, response_key: str, max_response_length: int, version: int
) -> list[Completion]:
    """Each row's own response (``extra_info[response_key]``) as a completion of its ``prompt_ids``:
    the text tokenised without special tokens, then EOS, cut to ``max_response_length`` (finish
    reason ``length``); weight version ``version``, log-probs zeros (no rollout sampled them)."""
    completions = []
    for i, (uid, prompt, info, index) in enumerate(
        zip(rows["uid"], rows["prompt_ids"], rows["extra_info"], rows["index"], strict=True)
    ):
        text = response_text(info, response_key, int(index))
        ids = list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]
        finish = "stop"
        if len(ids) > max_response_length:
            ids, finish = ids[:max_response_length], "length"
        completions.append(
            Completion(f"{uid}/{i}", tuple(prompt), ids, [0.0] * len(ids), [version] * len(ids), finish)
        )
    return completions


def dataset_rows(
    rows: Batch, completions: list[Completion], pad_id: int, widths: tuple[int, int] | None = None
) -> Batch:
    """``rows`` with their dataset ``completions`` as generation fields (padded to ``widths``, or to
    the longest), without ``rollout_log_probs``: the step's pass gives them (the student's own,
    :mod:`tandem.rl.stages.dataset_steps`)."""
    batch = with_completions(rows, completions, pad_id, widths)
    return batch.select([k for k in batch.keys() if k != "rollout_log_probs"])


class DatasetResponseMix:
    """A :class:`~tandem.pipeline.source.BatchSource` that serves the dataset's responses on
    off-policy steps and defers to ``inner`` on the others (see the module docstring).

    With ``workers`` (the actor's group: ``dataplane.enabled``, the draws kept in the store) an
    off-policy step's rows are built where they are read: the controller sends each rank its rows'
    requests (as a generation does: prompt ids and row columns), the rank tokenises the responses,
    pads its rows to ``prompt_width`` and keeps them in its store (``dataset_rows_to_store``), and
    a trimmed ``BatchRef`` comes back; otherwise the controller builds the ``Batch``."""

    def __init__(
        self,
        inner: Any,
        dataset: Any,
        sampler: Any,
        shape: StepShape,
        tokenizer: Any,
        lmbda: float,
        response_key: str,
        max_response_length: int,
        workers: Any = None,
        prompt_width: int = 0,
    ) -> None:
        assert workers is None or prompt_width > 0, "rows built on the ranks need the widest prompt's width"
        self.inner = inner
        self.dataset = dataset
        self.sampler = sampler
        self.shape = shape
        self.tokenizer = tokenizer
        self.lmbda = lmbda
        self.response_key = response_key
        self.max_response_length = max_response_length
        self.workers = workers
        self.prompt_width = prompt_width
        self.version = 0
        for index, sample in enumerate(dataset.samples):  # every row now, not when its step comes
            response_text(sample.extra_info, response_key, index)

    def next_batch(self, step: int, draw: int) -> tuple[Batch | BatchRef, dict[str, float]]:
        """The step's draw: the inner source's (on-policy) or the dataset's responses to the next
        prompts, each repeated ``shape.responses`` times (a group's rows are then alike)."""
        if not is_off_policy_step(self.shape.seed, step, self.lmbda):
            batch, metrics = self.inner.next_batch(step, draw)
            return _tagged(batch, False), {**metrics, "distill/off_policy_step": 0.0}
        indices = self.sampler.take(self.shape.groups)
        prompts = self.dataset.collate(indices)
        prompts = prompts.assign(non_tensors={"uid": [f"{step}-{draw}-{i}" for i in range(len(prompts))]})
        rows = _tagged(prompts.repeat(self.shape.responses, interleave=True), True)
        metrics = {"distill/off_policy_step": 1.0}
        if self.workers is not None:
            ref = self.workers.dataset_rows_to_store(
                rows,
                response_key=self.response_key,
                max_response_length=self.max_response_length,
                version=self.version,
                prompt_width=self.prompt_width,
            )
            return trim_stored(ref), metrics
        completions = dataset_completions(
            rows, self.tokenizer, self.response_key, self.max_response_length, self.version
        )
        pad_id = self.tokenizer.pad_token_id
        return trim_padding(dataset_rows(rows, completions, pad_id), pad_id), metrics

    # everything else is the inner source's
    def start(self, trainer_version: int) -> None:
        self.version = trainer_version
        self.inner.start(trainer_version)

    def generate(self, prompts, seeds, sampling, version):
        return self.inner.generate(prompts, seeds, sampling, version)

    def generate_to_store(self, prompts, seeds, sampling, version=None):
        return self.inner.generate_to_store(prompts, seeds, sampling, version)

    def after_update(self, version: int) -> dict[str, float]:
        self.version = version
        return self.inner.after_update(version)

    def host_pids(self) -> list[int]:
        return self.inner.host_pids()

    def agent_tool_totals(self):
        return self.inner.agent_tool_totals()

    def start_profile(self, directory: str) -> None:
        self.inner.start_profile(directory)

    def stop_profile(self) -> list[str]:
        return self.inner.stop_profile()

    def close(self, failed: bool = False) -> None:
        self.inner.close(failed)
