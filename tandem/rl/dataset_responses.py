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
uses them as both (:data:`OFF_POLICY`).
"""

from __future__ import annotations

import random
from typing import Any

from tandem.pipeline.source import StepShape
from tandem.protocol import Batch
from tandem.protocol.generation import Completion
from tandem.protocol.sequences import sequence_tensors, trim_padding
from tandem.seeds import derive_seed

OFF_POLICY = "off_policy"  # a non-tensor column: True on rows built from the dataset's responses
OFF_POLICY_SEED_TAG = 9_191_919  # derive_seed(run seed, this, step): the step's draw of lmbda


def is_off_policy_step(seed: int, step: int, lmbda: float) -> bool:
    """Whether ``step`` trains on the dataset's responses: a uniform draw from ``(seed, step)`` is
    at least ``lmbda`` (``lmbda=1``: never; ``lmbda=0``: always)."""
    return random.Random(derive_seed(seed, OFF_POLICY_SEED_TAG, step)).random() >= lmbda


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


class DatasetResponseMix:
    """A :class:`~tandem.pipeline.source.BatchSource` that serves the dataset's responses on
    off-policy steps and defers to ``inner`` on the others (see the module docstring)."""

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
    ) -> None:
        self.inner = inner
        self.dataset = dataset
        self.sampler = sampler
        self.shape = shape
        self.tokenizer = tokenizer
        self.lmbda = lmbda
        self.response_key = response_key
        self.max_response_length = max_response_length
        self.version = 0
        for index, sample in enumerate(dataset.samples):  # every row now, not when its step comes
            response_text(sample.extra_info, response_key, index)

    def next_batch(self, step: int, draw: int) -> tuple[Batch, dict[str, float]]:
        """The step's draw: the inner source's (on-policy) or the dataset's responses to the next
        prompts, each repeated ``shape.responses`` times (a group's rows are then alike)."""
        if not is_off_policy_step(self.shape.seed, step, self.lmbda):
            batch, metrics = self.inner.next_batch(step, draw)
            return batch.assign(non_tensors={OFF_POLICY: [False] * len(batch)}), {
                **metrics,
                "distill/off_policy_step": 0.0,
            }
        indices = self.sampler.take(self.shape.groups)
        prompts = self.dataset.collate(indices)
        prompts = prompts.assign(non_tensors={"uid": [f"{step}-{draw}-{i}" for i in range(len(prompts))]})
        rows = prompts.repeat(self.shape.responses, interleave=True)
        completions = [
            self._completion(f"{uid}/{i}", tuple(ids), info, int(index))
            for i, (uid, ids, info, index) in enumerate(
                zip(rows["uid"], rows["prompt_ids"], rows["extra_info"], rows["index"], strict=True)
            )
        ]
        tensors = sequence_tensors(rows["prompt_ids"], completions, self.tokenizer.pad_token_id)
        batch = rows.assign(
            tensors=tensors,
            non_tensors={
                "finish_reason": [c.finish_reason for c in completions],
                OFF_POLICY: [True] * len(rows),
            },
        )
        return trim_padding(batch, self.tokenizer.pad_token_id), {"distill/off_policy_step": 1.0}

    def _completion(
        self, request_id: str, prompt: tuple[int, ...], extra_info: dict, index: int
    ) -> Completion:
        text = response_text(extra_info, self.response_key, index)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.tokenizer.eos_token_id]
        finish = "stop"
        if len(ids) > self.max_response_length:
            ids, finish = ids[: self.max_response_length], "length"
        zeros = [0.0] * len(ids)  # replaced by the student's own log-probs before the update
        return Completion(request_id, prompt, ids, zeros, [self.version] * len(ids), finish)

    # everything else is the inner source's
    def start(self, trainer_version: int) -> None:
        self.version = trainer_version
        self.inner.start(trainer_version)

    def generate(self, prompts, seeds, sampling, version):
        return self.inner.generate(prompts, seeds, sampling, version)

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
