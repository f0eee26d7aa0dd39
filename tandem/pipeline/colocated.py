"""``ColocatedRollout``: the ``sync`` pipeline's batch source — the trainer workers' own engines.

A :class:`~tandem.pipeline.source.BatchSource` like the asynchronous pipelines' one: each draw
takes the next prompts from the sampler and generates their groups on the trainer's workers,
with the weights the last update left there.

With ``keep_in_store`` (the RL trainer's ``dataplane.enabled``, where its step supports it) a draw
stays in the data plane: each worker puts its rows' per-token fields into its own store and only
a :class:`~tandem.dataplane.BatchRef` comes back, with the per-row scalars and response texts
(:mod:`tandem.pipeline.stored_rollout`); the padding is trimmed by rewriting the reference. Its
requests name the prompts' rows (``PromptRows.requests``): the workers read their token ids.

With ``fixed_prompt_width`` (an agent program's run) every draw's rows, and validation's and
ReMax's greedy episodes, are laid out at ``prompt_width`` prompt columns before they are trimmed,
stored or not: an episode's prompt may be wider than the dataset's (a system prompt the program
adds), and a stored draw's width must be known before the draw. Both paths then hold the same rows, as the asynchronous replicas' do.
"""

from __future__ import annotations

from typing import Any

from tandem.dataplane import BatchRef
from tandem.pipeline.requests import PromptRows
from tandem.pipeline.source import StepShape
from tandem.pipeline.stored_rollout import trim_stored
from tandem.protocol import Batch
from tandem.protocol.sequences import trim_padding
from tandem.rollout import SamplingParams
from tandem.seeds import derive_seed


class ColocatedRollout:
    """Generation on the trainer's worker group (``generate_sequences``), weights copied in process.

    ``dataset`` holds the training prompts (:class:`~tandem.pipeline.requests.PromptRows`),
    ``sampler`` their order, ``shape`` what one draw holds; ``keep_in_store``: draws come back as
    ``BatchRef`` s, their prompts ``prompt_width`` (the training set's widest) tokens wide (see the
    module docstring; :meth:`generate`, for validation and baselines, still returns a ``Batch``);
    ``fixed_prompt_width``: draws off the store are laid out at ``prompt_width`` too."""

    def __init__(
        self,
        workers: Any,
        pad_id: int,
        dataset: PromptRows,
        sampler: Any,
        shape: StepShape,
        keep_in_store: bool = False,
        prompt_width: int = 0,
        fixed_prompt_width: bool = False,
    ) -> None:
        assert not (keep_in_store or fixed_prompt_width) or prompt_width > 0, "draws need a prompt width"
        self.workers = workers
        self.pad_id = pad_id
        self.dataset = dataset
        self.sampler = sampler
        self.shape = shape
        self.keep_in_store = keep_in_store
        self.prompt_width = prompt_width
        self.fixed_prompt_width = fixed_prompt_width

    def start(self, trainer_version: int) -> None:
        """Nothing to start: each worker loaded (or resumed) its rollout engine with the actor."""

    def next_batch(self, step: int, draw: int) -> tuple[Batch | BatchRef, dict[str, float]]:
        """The next ``shape.groups`` prompts, ``shape.responses`` responses each, generated now;
        group ``i`` of the draw is ``uid`` ``<step>-<draw>-<i>``, response ``j`` of the draw seeded
        from ``(seed, step, draw, j)``."""
        shape = self.shape
        indices = self.sampler.take(shape.groups)  # stored draws: the workers read the prompts' ids
        prompts = self.dataset.requests(indices) if self.keep_in_store else self.dataset.collate(indices)
        prompts = prompts.assign(non_tensors={"uid": [f"{step}-{draw}-{i}" for i in range(len(prompts))]})
        samples = prompts.repeat(shape.responses, interleave=True)
        seeds = [derive_seed(shape.seed, step, draw, i) for i in range(len(samples))]
        if self.keep_in_store:
            return self.generate_to_store(samples, seeds, shape.sampling), {}
        return self.generate(samples, seeds, shape.sampling, None), {}

    def generate_to_store(
        self, prompts: Batch, seeds: list[int], sampling: SamplingParams, version: int | None = None
    ) -> BatchRef:
        """As :meth:`generate`, the outputs kept on the workers: a trimmed ``BatchRef`` (for draws,
        and ReMax's greedy baselines of stored draws and validation, whose caller releases it).
        Every draw is stored at ``prompt_width`` (the longest training or validation prompt:
        padding costs no stored byte), so that draws join
        (:func:`tandem.pipeline.stored_rollout.concat_stored`: DAPO's); ``version`` as in
        :meth:`generate` (the engines hold the trainer's latest weights)."""
        ref = self.workers.generate_to_store(
            prompts.assign(non_tensors={"seed": seeds}),
            sampling=sampling,
            prompt_width=self.prompt_width,
        )
        return trim_stored(ref)

    def generate(
        self, prompts: Batch, seeds: list[int], sampling: SamplingParams, version: int | None
    ) -> Batch:
        """Responses of each row of ``prompts`` (one request per row, its own seed), laid out at
        ``prompt_width`` prompt columns with ``fixed_prompt_width`` (else at the widest of
        ``prompts``), then trimmed to the longest; the engines always hold the trainer's latest
        weights, whatever ``version`` asks."""
        width = self.prompt_width if self.fixed_prompt_width else max(len(p) for p in prompts["prompt_ids"])
        out = self.workers.generate_sequences(
            prompts.assign(non_tensors={"seed": seeds}), sampling=sampling, prompt_width=width
        )
        return trim_padding(Batch(dict(out.tensors.items()), out.non_tensors), self.pad_id)

    def after_update(self, version: int) -> dict[str, float]:
        """Copy the new weights into every worker's rollout engine; later tokens carry ``version``."""
        self.workers.sync_rollout_weights(version)
        return {}

    def host_pids(self) -> list[int]:
        """None of its own: generation runs in the trainer's workers."""
        return []

    def agent_tool_totals(self) -> list[dict[str, tuple[int, int, float]]]:
        """Each worker's tool ``(calls, errors, seconds)`` since the last call."""
        return self.workers.agent_tool_totals()

    def start_profile(self, directory: str) -> None:
        """Nothing more to profile: the engines run inside the (profiled) trainer workers."""

    def stop_profile(self) -> list[str]:
        return []

    def close(self, failed: bool = False) -> None:
        """Nothing to stop: the engines close with the workers."""
