"""``AsyncRollout``: generation on rollout replicas apart from the trainer, overlapped with training.

A :class:`~tandem.pipeline.source.BatchSource`: the RL trainer asks it for each step's batch
(:meth:`AsyncRollout.next_batch`) and tells it when the trainer has a new weight version
(:meth:`AsyncRollout.after_update`). It is the composition of two parts:

* a :class:`~tandem.pipeline.replica_set.ReplicaSet`: the replica processes, their weight syncs,
  the restart of a lost replica (``pipeline.replica_restarts``), profiling and shutdown;
* the policy of ``pipeline.mode`` (:mod:`tandem.pipeline.async_policy`), chosen once:
  ``one_step_off`` (batch ``k+1`` is generated with weights ``k-1`` while batch ``k`` trains;
  staleness exactly 0 or 1) or ``fully_async`` (the replicas generate continuously within
  ``staleness_threshold``, weights synced every ``trigger_parameter_sync_step`` steps,
  interrupting requests in flight when ``partial_rollout`` is on; groups that still end up too
  stale are dropped and counted). At each event the policy says whether to sync and how many
  prompt groups may be out; this class does it.

A step may draw more than once (DAPO's dynamic sampling): each further draw takes the next
groups, and the groups it consumed are handed out again on top of the staleness allowance, so
the replicas stay as far ahead as the bound lets them; the bound itself holds for every draw.

Prompts come from the trainer's sampler in order, read through
:class:`~tandem.pipeline.requests.PromptRows`; seeds from ``trainer.seed`` and the group's serial
number. The controller only sees metadata: the tensors stay in the replicas' shared-memory files
until :func:`~tandem.pipeline.assemble.assemble_batch` pulls them; with ``keep_in_store``
(``dataplane.enabled``) they stay in the replicas' data-plane blocks and never reach the
controller (:func:`~tandem.pipeline.assemble.assemble_stored` returns a ``BatchRef``; the step's
ranks fetch the rows). With ``pipeline.stream_forward`` the trainer's forward-only passes run on
the groups that have finished while the wait goes on (:meth:`AsyncRollout.stream_chunks`,
:mod:`tandem.pipeline.draw_chunks`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from tandem.dataplane import BatchRef, DataPlaneConfig
from tandem.pipeline.assemble import assemble_batch, assemble_stored
from tandem.pipeline.async_policy import Action, async_policy
from tandem.pipeline.draw_chunks import ChunkConsumer, DrawChunks
from tandem.pipeline.replica_plan import ReplicaPlan, replica_first_gpu
from tandem.pipeline.replica_set import ReplicaSet
from tandem.pipeline.replica_worker import RolloutReplicaWorker
from tandem.pipeline.requests import (
    GROUP_SEED_TAG,
    PromptPlaces,
    PromptRows,
    group_requests,
    rollout_requests,
    with_completions,
)
from tandem.pipeline.sample_queue import SampleQueue, wait_until
from tandem.pipeline.sample_store import inflight_bound
from tandem.pipeline.schedule_record import ScheduleRecord
from tandem.pipeline.stored_rollout import NEWEST_VERSION, OLDEST_VERSION, trim_stored, version_span
from tandem.protocol import Batch
from tandem.protocol.sequences import trim_padding
from tandem.rollout import SamplingParams

__all__ = [  # the names other modules import from here
    "GROUP_SEED_TAG",
    "AsyncRollout",
    "ReplicaPlan",
    "assemble_batch",
    "assemble_stored",
    "replica_first_gpu",
]

LOG = logging.getLogger(__name__)


class AsyncRollout:
    """See the module docstring. ``trainer`` is the trainer worker group (it sends the weights);
    ``prompts`` the training prompts, ``sampler`` their order; ``prompt_width`` the widest
    prompt's tokens (the width of the rows the replicas store with ``keep_in_store``); with
    ``places`` (the prompts' sources) the prompt groups name their rows' places
    (:meth:`PromptRows.requests`) and the replicas read the token ids and images themselves."""

    replica_class: type = RolloutReplicaWorker  # the worker each replica runs (tests substitute their own)

    def __init__(
        self,
        plan: ReplicaPlan,
        trainer: Any,
        prompts: PromptRows,
        sampler: Any,
        pad_id: int,
        keep_in_store: DataPlaneConfig | None = None,
        prompt_width: int = 0,
        places: PromptPlaces | None = None,
    ) -> None:
        assert keep_in_store is None or prompt_width > 0, "stored rows need the widest prompt's width"
        self.plan = plan
        self.keep_in_store = keep_in_store  # the replicas put training rows there (dataplane.enabled)
        self.pipeline = plan.pipeline
        self.prompts = prompts
        self.sampler = sampler
        self.pad_id = pad_id
        self.groups_per_step = plan.shape.groups
        self.policy = async_policy(self.pipeline, self.groups_per_step)
        # unbounded until start() knows the sample directory (pipeline.max_inflight_bytes)
        self.queue = SampleQueue(self.policy.staleness_threshold)
        record = self.pipeline.record_schedule
        self.schedule = ScheduleRecord(record) if record else None  # pipeline.record_schedule
        self.replica_set = ReplicaSet(
            plan, trainer, self.replica_class, keep_in_store, prompt_width, pad_id,
            self.policy.restart_pause, self.schedule.log_directory if self.schedule is not None else None,
            places,
        )  # fmt: skip
        self._serial = 0  # prompt groups handed out since start
        self._last_idle = 0.0
        self._last_waited = 0.0
        self._last_dropped = 0
        self._last_restarts = 0
        self._stream: tuple[ChunkConsumer, int] | None = None  # (consumer, groups per chunk)

    @property
    def replicas(self) -> Any:
        """The replicas' worker group (None before :meth:`start` and after :meth:`close`)."""
        return self.replica_set.group

    @property
    def rollout_version(self) -> int:
        """The weight version the replicas hold."""
        return self.replica_set.version

    # ------------------------------------------------------------------ lifecycle
    def start(self, trainer_version: int) -> None:
        """Spawn the replicas, join them to the trainer's weight sender, bring them to
        ``trainer_version`` (a resumed run) and hand out the first prompt groups."""
        replicas = self.replica_set
        replicas.spawn()
        bound = inflight_bound(self.pipeline.max_inflight_bytes, replicas.stored_directory)
        LOG.info("samples waiting for the trainer: at most %d bytes (pipeline.max_inflight_bytes)", bound)
        self.queue = SampleQueue(self.queue.staleness_threshold, bound, replicas.size)
        replicas.drive(self.queue)
        replicas.trainer_version = trainer_version
        self._act(self.policy.start(trainer_version), trainer_version)

    def close(self, failed: bool = False) -> None:
        """Stop the replicas and delete their stored samples (idempotent; see
        :meth:`ReplicaSet.close`, ``failed``: without ceremony)."""
        self.replica_set.close(failed)

    # ------------------------------------------------------------------ the trainer's calls
    def start_profile(self, directory: str) -> None:
        """Record the replicas with the PyTorch profiler until :meth:`stop_profile`; each writes
        ``<directory>/replica<N>.json`` (its calls and its engine's generation, as it overlaps
        the trainer's step)."""
        self.replica_set.start_profile(directory)

    def stop_profile(self) -> list[str]:
        """Stop the replicas' recording; returns the trace paths."""
        return self.replica_set.stop_profile()

    def stream_chunks(self, groups: int, consumer: ChunkConsumer) -> None:
        """From now on, hand ``consumer`` each draw's rows ``groups`` prompt groups at a time, as
        they finish (``pipeline.stream_forward``; :mod:`tandem.pipeline.draw_chunks`): those that
        finish while :meth:`next_batch` waits at once, the rest before it returns."""
        if self.keep_in_store is None:
            raise ValueError(
                "pipeline.stream_forward hands the trainer references to the replicas' blocks: it needs "
                "the draws kept there (dataplane.enabled=true, and every stage of the step plan taking stored draws)"
            )
        self._stream = (consumer, groups)

    def next_batch(self, step: int, draw: int) -> tuple[Batch | BatchRef, dict[str, float]]:
        """The prompt groups of step ``step``'s ``draw``-th draw (generation fields, as the sync
        pipeline makes them, plus ``weight_version``), and the draw's ``pipeline/*`` metrics; a
        ``BatchRef`` to the replicas' blocks with ``keep_in_store`` (:func:`assemble_stored`)."""
        assert self.replica_set.fleet is not None, "start() first"
        trainer_version = self.replica_set.trainer_version = step - 1
        self._act(self.policy.drawing(draw), trainer_version)
        chunks = (
            None
            if self._stream is None
            else DrawChunks(*self._stream, self.prompts, self.plan.shape.responses)
        )
        started = time.monotonic()
        groups = self.queue.take(
            self.groups_per_step, trainer_version, self.replica_set.check,
            **(chunks.take_args() if chunks is not None else {}),
        )  # fmt: skip
        waited = time.monotonic() - started
        if self.schedule is not None:
            self.schedule.write(step, draw, trainer_version, groups)
        metrics = {"pipeline/trainer_idle_s": waited, "pipeline/queue_depth": float(len(self.queue))}
        if chunks is not None:
            chunks.finish(groups)
            metrics.update(chunks.metrics(waited))
        metrics.update(self._act(self.policy.taken(self.rollout_version, trainer_version), trainer_version))
        n = self.plan.shape.responses
        if self.keep_in_store is not None:
            batch: Batch | BatchRef = assemble_stored(groups, self.prompts, n)
            oldest, newest = batch[OLDEST_VERSION], batch[NEWEST_VERSION]
        else:
            batch = assemble_batch(groups, self.prompts, n, self.pad_id)
            oldest, newest = version_span(batch["weight_version"], batch["response_mask"])
        metrics.update(self._step_metrics(oldest, newest, trainer_version))
        return batch, metrics

    def after_update(self, version: int) -> dict[str, float]:
        """The trainer now has weights ``version``: sync them when the policy says so and hand out
        the prompt groups that it now allows. Returns the sync's metrics."""
        self.replica_set.trainer_version = version
        metrics = self._act(self.policy.updated(version), version)
        if self.schedule is not None:  # the prompts drawn so far: what a replay's sampler resumes from
            self.schedule.write_sampler(version, self.sampler.state())
        return metrics

    def generate(
        self, prompts: Batch, seeds: list[int], sampling: SamplingParams, version: int | None
    ) -> Batch:
        """Responses of each row of ``prompts`` under weights ``version`` (validation): the replicas
        are brought up to ``version`` first, letting their running requests finish on the old ones;
        ``None`` takes the weights they hold. With agent loops each row is an episode."""
        self._bring_up_to(version)
        if self.plan.agent is not None:
            return trim_padding(self.replica_set.generate_episodes(prompts, seeds, sampling), self.pad_id)
        completions = self.replica_set.generate(rollout_requests(prompts, seeds, sampling, f"val-{version}"))
        return trim_padding(with_completions(prompts, completions, self.pad_id), self.pad_id)

    def generate_to_store(
        self, prompts: Batch, seeds: list[int], sampling: SamplingParams, version: int | None = None
    ) -> BatchRef:
        """As :meth:`generate` (under weights ``version``, or those the replicas hold), the outputs
        kept in the replicas' blocks (``keep_in_store``): a trimmed ``BatchRef`` of the rows' scalars
        and texts (ReMax's greedy baselines of stored draws, and validation; the caller releases it).
        With agent loops each row is an episode, its conversation among the scalars."""
        assert self.keep_in_store is not None, "rows kept in the replicas' blocks"
        self._bring_up_to(version)
        return trim_stored(self.replica_set.generate_to_store(prompts, seeds, sampling))

    def host_pids(self) -> list[int]:
        """The replicas' processes on this host."""
        return self.replica_set.host_pids()

    def agent_tool_totals(self) -> list[dict[str, tuple[int, int, float]]]:
        """Each replica's tool ``(calls, errors, seconds)`` since the last call."""
        return self.replica_set.agent_tool_totals()

    # ------------------------------------------------------------------ internals
    def _bring_up_to(self, version: int | None) -> None:
        """Sync the replicas to weights ``version`` when they are behind it, letting their running
        requests finish on the old ones (``None``: keep the weights they hold)."""
        assert self.replica_set.fleet is not None, "start() first"
        if version is not None and self.rollout_version < version:
            self.replica_set.sync(version, "wait")

    def _act(self, action: Action, version: int) -> dict[str, float]:
        """Do what the policy said: sync weights ``version`` (once every group handed out is back,
        with ``drain``), then hand out prompt groups up to the allowance. Returns the sync's metrics."""
        replicas, metrics = self.replica_set, {}
        if action.sync is not None:
            if action.drain:
                fleet = replicas.fleet
                assert fleet is not None
                wait_until(lambda: fleet.outstanding == 0, replicas.check)  # all handed out is done
            metrics = replicas.sync(version, action.sync)
        if action.hand_out:
            self._hand_out(self.policy.allowance(replicas.version, self.queue.dropped_stale) - self._serial)
        return metrics

    def _hand_out(self, count: int) -> None:
        """The sampler's next ``count`` prompts go to the replicas as prompt groups."""
        if count <= 0:
            return
        assert self.replica_set.fleet is not None
        indices = self.sampler.take(count)
        by_place = self.replica_set.places is not None
        rows = self.prompts.requests(indices) if by_place else self.prompts.collate(indices)
        requests = group_requests(rows, self._serial, self.plan.shape, self.plan.agent is not None)
        self._serial += len(requests)
        self.replica_set.fleet.submit(requests)

    def _step_metrics(
        self, oldest: torch.Tensor, newest: torch.Tensor, trainer_version: int
    ) -> dict[str, float]:
        """The draw's ``pipeline/*`` metrics; ``oldest``/``newest [B]``: each row's trained tokens'
        lowest and highest weight version (:func:`tandem.pipeline.stored_rollout.version_span`)."""
        fleet, restarts = self.replica_set.fleet, self.replica_set.restarts
        assert fleet is not None
        staleness = (trainer_version - oldest).float()
        idle = sum(fleet.idle_seconds()) / fleet.size
        waited = sum(fleet.waited_seconds())
        metrics = {
            "pipeline/inflight_bytes": float(self.queue.held_bytes),
            "pipeline/inflight_bytes_max": float(self.queue.read_peak()),
            "pipeline/rollout_wait_s": waited - self._last_waited,
            "pipeline/staleness/mean": float(staleness.mean()),
            "pipeline/staleness/max": float(staleness.max()),
            "pipeline/partial_samples": float((newest > oldest).sum()),
            "pipeline/rollout_idle_s": idle - self._last_idle,
            "pipeline/dropped_stale": float(self.queue.dropped_stale - self._last_dropped),
            "pipeline/rollout_version": float(self.rollout_version),
            "pipeline/replica_restarts": float(restarts - self._last_restarts),
        }
        self._last_idle, self._last_dropped, self._last_waited = idle, self.queue.dropped_stale, waited
        self._last_restarts = restarts
        return metrics
