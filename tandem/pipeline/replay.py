"""``ReplaySource``: a recorded asynchronous run's batches again, from its schedule record (``pipeline.replay``).

An asynchronous run's batches depend on timing (which replica finished first, which weights each
token was sampled under); its trainer is deterministic given them. With
``pipeline.record_schedule=PATH`` the run wrote down which groups each step's draws held
(:mod:`tandem.pipeline.schedule_record`), and its replicas kept each group's sample-file arrays in
a sample log beside the record (:mod:`tandem.pipeline.sample_log`). A :class:`ReplaySource` over
that record is the trainer's :class:`~tandem.pipeline.source.BatchSource`: at step ``s``, draw
``d`` it reads the groups the record's line for ``(s, d)`` names from the log, in the recorded
order, and builds the batch with :func:`~tandem.pipeline.assemble.assemble_batch`, the function the
recorded run built it with (or, with ``dataplane.enabled``, whose materialised batch its
``assemble_stored`` equals bit for bit). No replica runs and no weights are synced. After each
update it sets the trainer's prompt sampler to the state recorded after that update, so the
epoch a step logs and a checkpoint's sampler state are the recorded run's.

A step's metrics are then the recorded step's, bit for bit, apart from the ``pipeline/*`` ones of
the replicas and the queue (waits, syncs, bytes, queue depth: there are none here); the draw's
staleness metrics (``pipeline/staleness/*``, ``pipeline/partial_samples``) come from the batch's
weight versions as in the recorded run.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from tandem.pipeline.assemble import assemble_batch
from tandem.pipeline.sample_log import log_directory, read_entry
from tandem.pipeline.sample_queue import GroupMeta
from tandem.pipeline.sample_store import InlineSample
from tandem.pipeline.schedule_record import read_record
from tandem.pipeline.stored_rollout import version_span
from tandem.protocol import Batch
from tandem.protocol.generation import SamplingParams


def check_replayed_settings(path: str, recorded: list[dict[str, Any]], settings: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first key of ``settings`` (``{key as the user writes it:
    value}``) whose value differs from a run line's of the record at ``path``."""
    if not recorded:
        raise ValueError(
            f"pipeline.replay={path}: the record holds no run line (its run's settings); record the run "
            "again with pipeline.record_schedule"
        )
    ours = json.loads(json.dumps(settings))  # as the record holds them (tuples as lists)
    for run in recorded:
        for key in sorted(set(ours) | set(run)):
            if ours.get(key) != run.get(key):
                raise ValueError(
                    f"{key}={ours.get(key)!r}, but the run recorded in pipeline.replay={path} had "
                    f"{key}={run.get(key)!r}: a replay trains with the recorded run's settings"
                )


def staleness_metrics(oldest: torch.Tensor, newest: torch.Tensor, trainer_version: int) -> dict[str, float]:
    """A draw's staleness metrics, as :class:`~tandem.pipeline.runner.AsyncRollout` logs them;
    ``oldest`` / ``newest [B]``: each row's lowest and highest trained weight version."""
    staleness = (trainer_version - oldest).float()
    return {
        "pipeline/staleness/mean": float(staleness.mean()),
        "pipeline/staleness/max": float(staleness.max()),
        "pipeline/partial_samples": float((newest > oldest).sum()),
    }


class ReplaySource:
    """The batches of the run recorded at ``path`` (see the module docstring). ``dataset`` holds
    the training prompts (``collate``), ``sampler`` is the trainer's; ``responses``: ``rollout.n``;
    ``settings``: the run's, checked against the record's (:func:`check_replayed_settings`)."""

    def __init__(
        self, path: str, dataset: Any, sampler: Any, responses: int, pad_id: int, settings: dict[str, Any]
    ) -> None:
        self.path = path
        self.record = read_record(path)
        check_replayed_settings(path, self.record.runs, settings)
        self.log_dir = log_directory(path)
        if not os.path.isdir(self.log_dir):
            raise ValueError(
                f"pipeline.replay={path}: its sample log {self.log_dir} is missing (the replicas write it "
                "beside the record; move the two together)"
            )
        self.dataset = dataset
        self.sampler = sampler
        self.responses = responses
        self.pad_id = pad_id

    def start(self, trainer_version: int) -> None:
        """Nothing to start (a resumed run's sampler comes from its checkpoint)."""

    def next_batch(self, step: int, draw: int) -> tuple[Batch, dict[str, float]]:
        """The batch of step ``step``'s ``draw``-th draw in the record, and its staleness metrics."""
        line = self.record.draws.get((step, draw))
        if line is None:
            raise ValueError(
                f"pipeline.replay={self.path} has no draw {draw} of step {step} (its run recorded "
                f"{len(self.record.draws)} draw(s)); replay at most its steps (trainer.total_steps)"
            )
        groups = [self._group(entry, step) for entry in line["groups"]]
        batch = assemble_batch(groups, self.dataset, self.responses, self.pad_id)
        oldest, newest = version_span(batch["weight_version"], batch["response_mask"])
        return batch, staleness_metrics(oldest, newest, line["trainer_version"])

    def _group(self, entry: dict[str, Any], step: int) -> GroupMeta:
        """One recorded group, its tensors read back from the sample log."""
        reference = entry.get("sample_log")
        if not reference:
            raise ValueError(
                f"pipeline.replay={self.path}: group {entry['uid']!r} of step {step} has no sample log "
                "entry (its replica kept none)"
            )
        uid, tensors = read_entry(self.log_dir, reference)
        if uid != entry["uid"]:
            raise ValueError(
                f"pipeline.replay={self.path}: the sample log entry {reference} holds group {uid!r}, "
                f"not {entry['uid']!r} (a log from another run?)"
            )
        return GroupMeta(
            uid=uid,
            index=entry["index"],
            replica=entry["replica"],
            ref=InlineSample(tensors),
            min_version=entry["min_version"],
            max_version=entry["max_version"],
            finish_reasons=tuple(entry["finish_reasons"]),
            seconds=0.0,
            seeds=tuple(entry["seeds"]),
            request_ids=tuple(entry["request_ids"]),
            generation=entry["replica_generation"],
        )

    def after_update(self, version: int) -> dict[str, float]:
        """Set the sampler to its recorded state after weights ``version``; no sync, no metrics."""
        state = self.record.samplers.get(version)
        if state is not None:
            self.sampler.load_state(state)
        return {}

    def generate(
        self, prompts: Batch, seeds: list[int], sampling: SamplingParams, version: int | None
    ) -> Batch:
        """Refused: a replay runs no rollout engine."""
        raise ValueError(
            "pipeline.replay runs no rollout engine, so nothing can generate (validation, greedy "
            "baselines); set data.val_path= for a replay"
        )

    def host_pids(self) -> list[int]:
        return []

    def agent_tool_totals(self) -> list[dict[str, tuple[int, int, float]]]:
        return []

    def start_profile(self, directory: str) -> None:
        """Nothing generates here to profile."""

    def stop_profile(self) -> list[str]:
        return []

    def close(self, failed: bool = False) -> None:
        """Nothing to stop."""
