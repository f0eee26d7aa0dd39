"""``ColocatedRollout``: the ``sync`` pipeline's rollout — the trainer workers' own engines.

It offers the trainer the same calls as :class:`tandem.pipeline.runner.AsyncRollout`
(``start``, ``generate``, ``after_update``, ``close``), so the loop has one seam whatever the
mode; only where a step's batch comes from differs (the sync loop generates it in the step).
"""

from __future__ import annotations

from typing import Any

from tandem.protocol import Batch
from tandem.rl.sequences import trim_padding
from tandem.rollout import SamplingParams


class ColocatedRollout:
    """Generation on the trainer's worker group (``generate_sequences``), weights copied in process."""

    def __init__(self, workers: Any, pad_id: int) -> None:
        self.workers = workers
        self.pad_id = pad_id

    def start(self, trainer_version: int) -> None:
        """Nothing to start: each worker loaded (or resumed) its rollout engine with the actor."""

    def generate(self, prompts: Batch, seeds: list[int], sampling: SamplingParams, version: int) -> Batch:
        """Responses of each row of ``prompts`` (one request per row, its own seed), trimmed to the
        longest; the engines already hold weights ``version``."""
        out = self.workers.generate_sequences(
            prompts.assign(non_tensors={"seed": seeds}),
            sampling=sampling,
            prompt_width=max(len(p) for p in prompts["prompt_ids"]),
        )
        return trim_padding(Batch(dict(out.tensors.items()), out.non_tensors), self.pad_id)

    def after_update(self, version: int) -> dict[str, float]:
        """Copy the new weights into every worker's rollout engine; later tokens carry ``version``."""
        self.workers.sync_rollout_weights(version)
        return {}

    def agent_tool_totals(self) -> list[dict[str, tuple[int, int, float]]]:
        """Each worker's tool ``(calls, errors, seconds)`` since the last call."""
        return self.workers.agent_tool_totals()

    def start_profile(self, directory: str) -> None:
        """Nothing more to profile: the engines run inside the (profiled) trainer workers."""

    def stop_profile(self) -> list[str]:
        return []

    def close(self, failed: bool = False) -> None:
        """Nothing to stop: the engines close with the workers."""
