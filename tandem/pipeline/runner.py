"""``AsyncRollout``: generation on rollout replicas apart from the trainer, overlapped with training.

A :class:`~tandem.pipeline.source.BatchSource`: the RL trainer asks it for each step's batch
(:meth:`AsyncRollout.next_batch`) and tells it when the trainer has a new weight version
(:meth:`AsyncRollout.after_update`). What runs in between depends on ``pipeline.mode``:

* ``one_step_off`` — batch ``k+1`` is generated with weights ``k-1`` while batch ``k`` trains.
  When batch ``k`` has been taken the replicas are idle: they receive weights ``k-1`` and
  start batch ``k+1``; then the trainer trains on batch ``k``. Staleness is exactly 0 or 1.
* ``fully_async`` — the replicas generate continuously. A prompt group may start only while
  it can still be trained within ``staleness_threshold`` versions of the weights it starts
  under (counting groups already handed out); every ``trigger_parameter_sync_step`` trainer
  steps the new weights go to the replicas, interrupting requests in flight when
  ``partial_rollout`` is on (their later tokens carry the new version). Groups that still
  end up too stale are dropped and counted.

A replica that dies, hangs or fails ends the run with an error naming it, unless
``pipeline.replica_restarts`` allows a restart: then a fresh process takes its place, every
replica leaves the weight sender and joins a new one (a broadcast group cannot lose a member),
all of them receive the trainer's current weights, and the prompt groups the lost replica held
are generated again by the new one. The staleness bound holds as before: the groups start
again under newer weights.

A step may draw more than once (DAPO's dynamic sampling): each further draw takes the next
groups, and the groups it consumed are handed out again on top of the staleness allowance, so
the replicas stay as far ahead as the bound lets them; the bound itself holds for every draw.

Prompts come from the trainer's sampler in order; seeds from ``trainer.seed`` and the group's
serial number. The controller only sees metadata: the tensors stay in the replicas'
shared-memory files until :func:`assemble_batch` pulls them; with ``keep_in_store``
(``dataplane.enabled``) they stay in the replicas' data-plane blocks and never reach the
controller (:func:`assemble_stored` returns a ``BatchRef``; the step's ranks fetch the rows).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tandem.agents.config import AgentConfig
from tandem.checkpoint_engine.roles import PendingSync, connect_weight_sync, start_weight_sync
from tandem.checkpoint_engine.transports import SLOT_PREFIX
from tandem.controller import ResourcePool, create_worker_group
from tandem.controller.errors import WorkerDiedError, WorkerError
from tandem.dataplane import BatchRef, DataPlaneConfig
from tandem.dataplane.shm import discard_blocks_of
from tandem.device import cuda_device_count
from tandem.errors import RolloutReplicaError
from tandem.pipeline.config import PipelineConfig
from tandem.pipeline.fleet import RolloutFleet
from tandem.pipeline.groups import EpisodePrompt, GroupRequest
from tandem.pipeline.provenance import provenance_columns
from tandem.pipeline.replica_worker import RolloutReplicaWorker
from tandem.pipeline.sample_queue import GroupMeta, SampleQueue, wait_until
from tandem.pipeline.sample_store import discard_files_of, inflight_bound, read_fields, release
from tandem.pipeline.schedule_record import ScheduleRecord
from tandem.pipeline.source import StepShape
from tandem.pipeline.stored_rollout import NEWEST_VERSION, OLDEST_VERSION, trim_stored, version_span
from tandem.protocol import Batch
from tandem.protocol.generation import Completion
from tandem.protocol.sequences import sequence_tensors, trim_padding
from tandem.rollout import RolloutRequest, SamplingParams
from tandem.rollout.config import RolloutEngineConfig
from tandem.seeds import derive_seed

LOG = logging.getLogger(__name__)
GROUP_SEED_TAG = 202  # derive_seed(run seed, this, group serial, response): an async group's seeds


@dataclass(frozen=True)
class ReplicaPlan:
    """What the asynchronous pipelines take from a run's config, decided by the trainer.

    Attributes:
        pipeline: ``pipeline.*``.
        engine: each replica's rollout engine.
        model_path: the model the replicas load (weights then arrive from the trainer).
        device: ``auto``, ``cpu`` or ``cuda``.
        backend: ``process`` (this machine) or ``ray``.
        pool: the replicas' placement.
        first_gpu: replica 0's local GPU index (:func:`replica_first_gpu`).
        shape: what one draw holds; each group's seeds derive from its seed and the group's
            serial number.
        agent: the agent loops' settings when groups run as agent episodes, else ``None``.
    """

    pipeline: PipelineConfig
    engine: RolloutEngineConfig
    model_path: str
    device: str
    backend: str
    pool: ResourcePool
    first_gpu: int
    shape: StepShape
    agent: AgentConfig | None


class AsyncRollout:
    """See the module docstring. ``trainer`` is the trainer worker group (it sends the weights);
    ``dataset`` the training prompts (``samples`` and ``collate``), ``sampler`` their order."""

    replica_class: type = RolloutReplicaWorker  # the worker each replica runs (tests substitute their own)

    def __init__(
        self,
        plan: ReplicaPlan,
        trainer: Any,
        dataset: Any,
        sampler: Any,
        pad_id: int,
        keep_in_store: DataPlaneConfig | None = None,
    ) -> None:
        self.plan = plan
        self.keep_in_store = keep_in_store  # the replicas put training rows there (dataplane.enabled)
        self.pipeline = plan.pipeline
        self.trainer = trainer
        self.dataset = dataset
        self.sampler = sampler
        self.pad_id = pad_id
        self.groups_per_step = plan.shape.groups
        fully_async = self.pipeline.mode == "fully_async"
        # unbounded until start() knows the sample directory (pipeline.max_inflight_bytes)
        self.queue = SampleQueue(self.pipeline.staleness_threshold if fully_async else None)
        self.rollout_version = 0
        self._start_version = 0  # the trainer's version when the pipeline started (a resumed run's step)
        self._serial = 0  # prompt groups handed out since start
        self._redrawn = 0  # prompt groups taken by a step's further draws (dynamic sampling)
        self._last_idle = 0.0
        self._last_waited = 0.0
        self._last_dropped = 0
        self.replicas: Any = None
        self._sample_dir = self._weights_dir = "/dev/shm"
        self.fleet: RolloutFleet | None = None
        self._pending_sync: PendingSync | None = None  # sent; the replicas may still be loading it
        self._trainer_version = 0  # the trainer's newest weights, as far as this source was told
        self._restarts = 0  # replicas restarted since start
        self._last_restarts = 0
        self._dead_pids: list[int] = []  # this host's replica processes lost and replaced
        self._last_sync_gb_per_s = 0.0  # of the sync a restart made
        record = self.pipeline.record_schedule
        self.schedule = ScheduleRecord(record) if record else None  # pipeline.record_schedule

    # ------------------------------------------------------------------ lifecycle
    def start(self, trainer_version: int) -> None:
        """Spawn the replicas, join them to the trainer's weight sender, bring them to
        ``trainer_version`` (a resumed run) and hand out the first prompt groups."""
        plan, pipeline = self.plan, self.pipeline
        weights = pipeline.checkpoint_engine
        self._sample_dir = (weights.directory if weights.backend == "shared_memory" else "") or "/dev/shm"
        self._weights_dir = weights.directory or "/dev/shm"
        self.replicas = create_worker_group(
            self.replica_class, plan.pool, plan.backend,
            args=(
                plan.engine, plan.model_path, plan.device, pipeline.rollout_threads, self._sample_dir,
                plan.agent, plan.first_gpu,
            ),
        )  # fmt: skip
        inline = self._replicas_sending_inline()
        if inline:
            self.replicas.write_samples_inline(inline)
        self._keep_samples_in_store(list(range(self.replicas.world_size)))
        if self.schedule is not None:  # the replicas keep what they report beside it, for a replay
            self.replicas.log_samples(list(range(self.replicas.world_size)), self.schedule.log_directory)
        connect_weight_sync(self.trainer, self.replicas, pipeline.checkpoint_engine)
        stored = self.keep_in_store.directory if self.keep_in_store is not None else self._sample_dir
        bound = inflight_bound(pipeline.max_inflight_bytes, stored)
        LOG.info("samples waiting for the trainer: at most %d bytes (pipeline.max_inflight_bytes)", bound)
        self.queue = SampleQueue(self.queue.staleness_threshold, bound, self.replicas.world_size)
        self.fleet = RolloutFleet(self.replicas, self.queue, pipeline.replica_timeout_s)
        self._start_version = self._trainer_version = trainer_version
        if trainer_version > 0:
            self._send(trainer_version, "abort")
        self._hand_out(self._allowance())

    def close(self, failed: bool = False) -> None:
        """Abort what is in flight, drop what is queued, stop the replicas and delete their stored
        samples (idempotent). After a failure (``failed``, or one a replica driver saw) the replicas
        are stopped without ceremony: the trainer may still be inside a weight sync that waits for a
        dead replica, so no call goes to it, and the files are deleted by name."""
        failed = failed or (self.fleet is not None and self.fleet.error is not None)
        if self.fleet is not None:
            self.fleet.close()
            self.fleet = None
        if self.replicas is None:
            return
        replica_pids = _local_pids(self.replicas) + self._dead_pids
        try:
            if not failed:
                self._settle()
                self.trainer.close_weight_sender()
                self.replicas.close_engine()
        finally:
            self.replicas.shutdown()
            self.replicas = None
            for pid in replica_pids:
                discard_files_of(pid, self._sample_dir)
                if self.keep_in_store is not None:  # blocks of groups never trained (a lost replica's too)
                    discard_blocks_of(pid, self.keep_in_store.directory)
            if failed:
                for pid in _local_pids(self.trainer):
                    discard_files_of(pid, self._weights_dir, SLOT_PREFIX)

    # ------------------------------------------------------------------ the trainer's calls
    def start_profile(self, directory: str) -> None:
        """Record the replicas with the PyTorch profiler until :meth:`stop_profile`; each writes
        ``<directory>/replica<N>.json`` (its calls and its engine's generation, as it overlaps
        the trainer's step)."""
        with self.fleet.hold():
            self.replicas.start_profile(directory)

    def stop_profile(self) -> list[str]:
        """Stop the replicas' recording; returns the trace paths."""
        with self.fleet.hold():
            return self.replicas.stop_profile()

    def next_batch(self, step: int, draw: int) -> tuple[Batch | BatchRef, dict[str, float]]:
        """The prompt groups of step ``step``'s ``draw``-th draw (generation fields, as the sync
        pipeline makes them, plus ``weight_version``), and the draw's ``pipeline/*`` metrics; a
        ``BatchRef`` to the replicas' blocks with ``keep_in_store`` (:func:`assemble_stored`)."""
        assert self.fleet is not None, "start() first"
        trainer_version = self._trainer_version = step - 1
        if draw > 1 and self.pipeline.mode == "fully_async":
            self._redrawn += self.groups_per_step  # replaced on top of the allowance
            self._hand_out(self._allowance() - self._serial)
        started = time.monotonic()
        groups = self.queue.take(self.groups_per_step, trainer_version, self._check)
        waited = time.monotonic() - started
        if self.schedule is not None:
            self.schedule.write(step, draw, trainer_version, groups)
        metrics = {"pipeline/trainer_idle_s": waited, "pipeline/queue_depth": float(len(self.queue))}
        if self.pipeline.mode == "one_step_off":
            if self.rollout_version < trainer_version:
                wait_until(lambda: self.fleet.outstanding == 0, self._check)  # all handed out is done
                metrics.update(self._send(trainer_version, "keep"))
            self._hand_out(self.groups_per_step)
        n = self.plan.shape.responses
        if self.keep_in_store is not None:
            batch: Batch | BatchRef = assemble_stored(groups, self.dataset, n)
            oldest, newest = batch[OLDEST_VERSION], batch[NEWEST_VERSION]
        else:
            batch = assemble_batch(groups, self.dataset, n, self.pad_id)
            oldest, newest = version_span(batch["weight_version"], batch["response_mask"])
        metrics.update(self._step_metrics(oldest, newest, trainer_version))
        return batch, metrics

    def after_update(self, version: int) -> dict[str, float]:
        """The trainer now has weights ``version``: sync them on schedule (fully async) and hand out
        the prompt groups that the staleness bound now allows. Returns the sync's metrics."""
        metrics: dict[str, float] = {}
        self._trainer_version = version
        if self.pipeline.mode == "fully_async":
            if version % self.pipeline.trigger_parameter_sync_step == 0:
                metrics = self._send(version, "keep" if self.pipeline.partial_rollout else "wait")
            self._hand_out(self._allowance() - self._serial)
        if self.schedule is not None:  # the prompts drawn so far: what a replay's sampler resumes from
            self.schedule.write_sampler(version, self.sampler.state())
        return metrics

    def generate(
        self, prompts: Batch, seeds: list[int], sampling: SamplingParams, version: int | None
    ) -> Batch:
        """Responses of each row of ``prompts`` under weights ``version`` (validation): the replicas
        are brought up to ``version`` first, letting their running requests finish on the old ones;
        ``None`` takes the weights they hold. With agent loops each row is an episode."""
        assert self.fleet is not None, "start() first"
        if version is not None and self.rollout_version < version:
            self._send(version, "wait")
        if self.plan.agent is not None:
            with self.fleet.hold():
                out = self.replicas.generate_episodes(
                    prompts.assign(non_tensors={"seed": seeds}),
                    sampling=sampling,
                    prompt_width=max(len(p) for p in prompts["prompt_ids"]),
                )
            return trim_padding(out, self.pad_id)
        images = prompts["images"] if "images" in prompts else [None] * len(prompts)
        requests = [
            RolloutRequest(
                f"val-{version}-{i}", tuple(ids), dataclasses.replace(sampling, seed=int(seed)), pictures
            )
            for i, (ids, seed, pictures) in enumerate(zip(prompts["prompt_ids"], seeds, images, strict=True))
        ]
        completions = self._recovering(lambda: self.fleet.generate(requests))
        tensors = sequence_tensors(prompts["prompt_ids"], completions, self.pad_id)
        batch = prompts.assign(
            tensors=tensors, non_tensors={"finish_reason": [c.finish_reason for c in completions]}
        )
        return trim_padding(batch, self.pad_id)

    def host_pids(self) -> list[int]:
        """The replicas' processes on this host."""
        return _local_pids(self.replicas) if self.replicas is not None else []

    def agent_tool_totals(self) -> list[dict[str, tuple[int, int, float]]]:
        """Each replica's tool ``(calls, errors, seconds)`` since the last call."""

        def totals() -> list[dict[str, tuple[int, int, float]]]:
            with self.fleet.hold():
                return self.replicas.agent_tool_totals()

        return self._recovering(totals)

    # ------------------------------------------------------------------ internals
    def _replicas_sending_inline(self) -> list[int]:
        """The replicas whose samples travel with their metadata (``pipeline.sample_store``)."""
        everyone = list(range(self.replicas.world_size))
        if self.pipeline.sample_store == "inline":
            return everyone
        seen = self.replicas.ranks_seeing(self._sample_dir)
        blind = [rank for rank in everyone if rank not in seen]
        if blind and self.pipeline.sample_store == "shared_memory":
            raise ValueError(
                f"pipeline.sample_store=shared_memory, but rollout replica {blind[0]} cannot read files this "
                f"process writes in {self._sample_dir} (another host or container); use auto or inline"
            )
        if blind and self.keep_in_store is not None:
            raise ValueError(
                f"dataplane.enabled=true keeps the samples in the replicas' {self.keep_in_store.directory}, "
                f"but rollout replica {blind[0]} cannot share files with this process (another host or "
                "container); set pipeline.sample_store=inline, or dataplane.enabled=false"
            )
        return blind

    def _keep_samples_in_store(self, ranks: list[int]) -> None:
        """The replicas ``ranks`` put their finished groups into the data plane (``keep_in_store``),
        as training rows of the run's fixed widths."""
        if self.keep_in_store is None or not ranks:
            return
        prompt_width = max(len(sample.prompt_ids) for sample in self.dataset.samples)
        response_width = self.plan.shape.sampling.max_tokens
        self.replicas.keep_samples_in_store(
            ranks, self.keep_in_store, prompt_width, response_width, self.pad_id
        )

    def _allowance(self) -> int:
        """Prompt groups that may have been handed out by now (see the module docstring)."""
        if self.pipeline.mode == "one_step_off":
            return self.groups_per_step
        ahead = self.rollout_version - self._start_version + self.pipeline.staleness_threshold + 1
        return ahead * self.groups_per_step + self.queue.dropped_stale + self._redrawn

    def _hand_out(self, count: int) -> None:
        if count <= 0:
            return
        assert self.fleet is not None
        plan = self.plan
        requests = []
        for index in self.sampler.take(count):
            serial = self._serial
            self._serial += 1
            seeds = tuple(
                derive_seed(plan.shape.seed, GROUP_SEED_TAG, serial, i) for i in range(plan.shape.responses)
            )
            sample = self.dataset.samples[index]
            episode = (
                EpisodePrompt(tuple(sample.raw_prompt), dict(sample.extra_info or {}), sample.agent_name)
                if plan.agent is not None
                else None
            )
            images = self.dataset.image_inputs(sample)  # None: a text prompt
            requests.append(
                GroupRequest(
                    f"g{serial}", index, tuple(sample.prompt_ids), seeds, plan.shape.sampling, episode, images
                )
            )
        self.fleet.submit(requests)

    def _send(self, version: int, pause: str) -> dict[str, float]:
        """Sync weights ``version`` to every replica (``pause``: what their running requests do).

        The trainer goes on as soon as the buckets are posted; the replicas load them meanwhile.
        A replica runs its calls in order, so every request started after this runs on the new
        weights; the next sync first waits until every replica has applied this one.
        """
        assert self.fleet is not None
        started = time.monotonic()
        try:
            with self.fleet.hold():
                self._settle()
                self._pending_sync = start_weight_sync(self.trainer, self.replicas, version, pause)
            self.rollout_version = version
            gb_per_s = self._pending_sync.stats.gb_per_s
        except RolloutReplicaError as error:
            if not self._restart_failed(error):
                raise
            gb_per_s = self._last_sync_gb_per_s  # the restart sent every replica the newest weights
        return {"pipeline/weight_sync_s": time.monotonic() - started, "pipeline/weight_sync_gbps": gb_per_s}

    def _check(self) -> None:
        """Raise a replica's failure (one that died while loading the last sync is named with
        it), or restart the replica when ``pipeline.replica_restarts`` allows."""
        try:
            self.fleet.check()
        except RolloutReplicaError as error:
            if self._restart_failed(error):
                return
            pending = self._pending_sync
            if pending is not None and pending.received.done():
                self._settle()  # raises, naming the weight version it failed to receive
            raise

    def _recovering(self, call: Callable[[], Any]) -> Any:
        """``call()``, again after each replica failure it meets that a restart repairs."""
        while True:
            try:
                return call()
            except (RolloutReplicaError, WorkerDiedError, WorkerError) as error:
                if not self._restart_failed(error):
                    raise

    def _restart_failed(self, error: Exception) -> bool:
        """Replace the failed replicas (``error``'s and any the fleet saw) when the restart budget
        allows (see the module docstring); False when it does not, and the caller raises."""
        ranks = set(self.fleet.failures)
        if getattr(error, "rank", None) is not None:
            ranks.add(error.rank)
        if not ranks or self._restarts + len(ranks) > self.pipeline.replica_restarts:
            return False
        with self.fleet.hold():
            self._pending_sync = None  # abandoned: every replica receives the newest weights below
            before = set(_local_pids(self.replicas))
            for rank in sorted(ranks):
                LOG.warning("rollout replica %d failed (%s); restarting it", rank, str(error).splitlines()[0])
                self.replicas.restart(rank)
            self._dead_pids.extend(before - set(_local_pids(self.replicas)))
            self._rejoin_weight_sync(sorted(ranks))
        for rank in sorted(ranks):
            self.fleet.revive(rank)
        self._restarts += len(ranks)
        return True

    def _rejoin_weight_sync(self, restarted: list[int]) -> None:
        """Every replica joins a new weight sender and receives the trainer's newest weights."""
        inline = [rank for rank in self._replicas_sending_inline() if rank in restarted]
        if inline:
            self.replicas.write_samples_inline(inline)
        self._keep_samples_in_store(restarted)
        if self.schedule is not None:
            self.replicas.log_samples(restarted, self.schedule.log_directory)
        self.replicas.disconnect_weights()
        self.trainer.close_weight_sender()
        connect_weight_sync(self.trainer, self.replicas, self.pipeline.checkpoint_engine)
        partial = self.pipeline.mode == "fully_async" and self.pipeline.partial_rollout
        self._pending_sync = start_weight_sync(
            self.trainer, self.replicas, self._trainer_version, "keep" if partial else "wait"
        )
        self._last_sync_gb_per_s = self._pending_sync.stats.gb_per_s
        self._settle()
        self.rollout_version = self._trainer_version

    def _settle(self) -> None:
        """Wait until the replicas have applied the last sync (a failed replica raises, named)."""
        pending, self._pending_sync = self._pending_sync, None
        if pending is not None:
            pending.finish()

    def _step_metrics(
        self, oldest: torch.Tensor, newest: torch.Tensor, trainer_version: int
    ) -> dict[str, float]:
        """The draw's ``pipeline/*`` metrics; ``oldest``/``newest [B]``: each row's trained tokens'
        lowest and highest weight version (:func:`tandem.pipeline.stored_rollout.version_span`)."""
        assert self.fleet is not None
        staleness = (trainer_version - oldest).float()
        idle = sum(self.fleet.idle_seconds()) / self.fleet.size
        waited = sum(self.fleet.waited_seconds())
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
            "pipeline/replica_restarts": float(self._restarts - self._last_restarts),
        }
        self._last_idle, self._last_dropped, self._last_waited = idle, self.queue.dropped_stale, waited
        self._last_restarts = self._restarts
        return metrics


def assemble_batch(groups: list[GroupMeta], dataset: Any, n: int, pad_id: int) -> Batch:
    """The training rows of ``groups`` (``n`` responses each): their prompts from ``dataset`` (an
    agent episode's own prompt, rendered with the tools' schemas) and their responses pulled from
    the sample store (whose files are released). Each response is a view of the mapped file until
    it is copied once, into the padded batch. Every row carries its provenance
    (:mod:`tandem.pipeline.provenance`)."""
    prompts = dataset.collate([g.index for g in groups]).repeat(n, interleave=True)
    prompt_ids: list[Any] = list(prompts["prompt_ids"])
    completions: list[Completion] = []
    for g, group in enumerate(groups):
        fields = read_fields(group.ref)
        spans = _spans(fields["lengths"])
        prompt_spans = _spans(fields["prompt_lengths"]) if group.episodes else []
        routed_spans = _spans(fields["routed_lengths"]) if "routed_lengths" in fields else []
        for i, (start, end) in enumerate(spans):
            completions.append(
                Completion(
                    f"{group.uid}/{i}",
                    (),
                    fields["token_ids"][start:end],  # type: ignore[arg-type]
                    fields["log_probs"][start:end],  # type: ignore[arg-type]
                    fields["versions"][start:end],  # type: ignore[arg-type]
                    group.finish_reasons[i],  # type: ignore[arg-type]
                    token_mask=fields["token_mask"][start:end] if group.episodes else None,  # type: ignore[arg-type]
                    routed_experts=fields["routed_experts"][slice(*routed_spans[i])]
                    if routed_spans
                    else None,
                )
            )
            if group.episodes:
                begin, stop = prompt_spans[i]
                prompt_ids[g * n + i] = fields["prompt_ids"][begin:stop].tolist()
        release(group.ref)
    tensors = sequence_tensors(prompt_ids, completions, pad_id)
    non_tensors: dict[str, list] = {
        "uid": [g.uid for g in groups for _ in range(n)],
        "finish_reason": [c.finish_reason for c in completions],
        **provenance_columns(groups),
    }
    if groups and groups[0].episodes:
        episodes = [e for g in groups for e in g.episodes]
        non_tensors.update(
            agent_messages=[e.messages for e in episodes],
            agent_turns=[e.turns for e in episodes],
            agent_tool_calls=[e.tool_calls for e in episodes],
            agent_tool_errors=[e.tool_errors for e in episodes],
            agent_reward=[e.reward for e in episodes],
        )
        if episodes[0].program_log is not None:  # an agent program's episodes
            non_tensors.update(
                agent_program_splits=[e.program_splits for e in episodes],
                agent_program_metrics=[e.program_metrics for e in episodes],
                agent_program_log=[e.program_log for e in episodes],
            )
    batch = prompts.assign(tensors=tensors, non_tensors=non_tensors)
    return trim_padding(batch, pad_id)


def assemble_stored(groups: list[GroupMeta], dataset: Any, n: int) -> BatchRef:
    """The training rows of ``groups`` (``n`` responses each, stored by their replicas:
    :mod:`tandem.pipeline.group_blocks`) as one ``BatchRef``: the prompts' columns from ``dataset``
    (without their ``prompt_ids``) and each row's ``uid``, ``finish_reason`` and provenance
    (:mod:`tandem.pipeline.provenance`) inline, the groups'
    references concatenated, and every stored field cropped to the batch's longest prompt and
    response. It materialises to :func:`assemble_batch`'s batch of the same groups (less
    ``prompt_ids``, plus the inline scalars of :func:`tandem.pipeline.stored_rollout.store_rollout`);
    no block is read. The blocks are released by whoever ends the step."""
    prompts = dataset.collate([g.index for g in groups]).repeat(n, interleave=True)
    columns = prompts.select([k for k in prompts.keys() if k != "prompt_ids"]).assign(
        non_tensors={
            "uid": [g.uid for g in groups for _ in range(n)],
            "finish_reason": [reason for g in groups for reason in g.finish_reasons],
            **provenance_columns(groups),
        }
    )
    rows = BatchRef.concat([g.ref for g in groups])  # type: ignore[misc]
    return trim_stored(BatchRef(columns, (), {}).union(rows))


def _spans(lengths: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each of the consecutive pieces of ``lengths``."""
    ends = lengths.cumsum(0).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _local_pids(group: Any) -> list[int]:
    """The processes on this host that run ``group``'s workers."""
    return list(group.backend.host_pids)


def replica_first_gpu(
    pipeline: PipelineConfig, backend: str, device: str, trainer_workers: int, gpus_per_replica: int = 1
) -> int:
    """The local GPU index replica 0 binds: with the local backend the ``trainer_workers`` workers
    of this machine hold GPUs ``0 .. W-1``, so the replicas take the next ones, ``gpus_per_replica``
    each (Ray gives each replica GPUs of its own instead). A machine without enough GPUs wraps
    around, replicas sharing the trainer's; the broadcast backend cannot, since NCCL refuses two
    ranks of one group on one GPU: an error naming the keys."""
    if backend == "ray":
        return 0
    gpus = cuda_device_count()
    on_gpu = gpus > 0 and device != "cpu"
    wanted = trainer_workers + pipeline.rollout_replicas * gpus_per_replica
    if on_gpu and wanted > gpus and pipeline.checkpoint_engine.backend == "broadcast":
        raise ValueError(
            f"{trainer_workers} trainer worker(s) and pipeline.rollout_replicas={pipeline.rollout_replicas} "
            f"({gpus_per_replica} GPU(s) each) need {wanted} GPUs for pipeline.checkpoint_engine.backend=broadcast (NCCL needs a GPU per rank), "
            f"and this machine has {gpus}; use fewer replicas or pipeline.checkpoint_engine.backend=shared_memory"
        )
    return trainer_workers
