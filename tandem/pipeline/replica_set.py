"""``ReplicaSet``: the rollout replicas of an asynchronous pipeline, to start, sync, repair and stop.

:meth:`ReplicaSet.spawn` starts one process per replica (:func:`spawn_replicas`), tells each
where its finished groups go (its own shared-memory files, inline with their metadata, or the
data plane's blocks) and joins them all to the trainer's weight sender; :meth:`ReplicaSet.drive`
hands them to a :class:`~tandem.pipeline.fleet.RolloutFleet`, whose drivers feed the sample
queue. :meth:`ReplicaSet.sync` sends a weight version: the trainer goes on as soon as the buckets
are posted, and the next sync first waits until every replica has applied this one.

A replica that dies, hangs or fails ends the run with an error naming it, unless
``pipeline.replica_restarts`` allows a restart: then a fresh process takes its place, every
replica leaves the weight sender and joins a new one (a broadcast group cannot lose a member),
all of them receive the trainer's current weights, and the prompt groups the lost replica held
are generated again by the new one (:meth:`RolloutFleet.revive`). :meth:`ReplicaSet.check` and
:meth:`ReplicaSet.recovering` are where a failure is met. :meth:`ReplicaSet.close` stops the
replicas and deletes what they stored, whichever way the run ended.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tandem.checkpoint_engine.roles import PendingSync, connect_weight_sync, start_weight_sync
from tandem.checkpoint_engine.transports import SLOT_PREFIX
from tandem.controller import create_worker_group
from tandem.controller.errors import WorkerDiedError, WorkerError
from tandem.dataplane import BatchRef, DataPlaneConfig
from tandem.dataplane.shm import discard_blocks_of
from tandem.errors import RolloutReplicaError
from tandem.pipeline.fleet import RolloutFleet
from tandem.pipeline.replica_plan import ReplicaPlan
from tandem.pipeline.requests import PromptPlaces
from tandem.pipeline.sample_queue import SampleQueue
from tandem.pipeline.sample_store import discard_files_of
from tandem.protocol import Batch
from tandem.protocol.generation import Completion
from tandem.rollout import RolloutRequest, SamplingParams

LOG = logging.getLogger(__name__)


def spawn_replicas(replica_class: type, plan: ReplicaPlan, sample_dir: str) -> Any:
    """The replicas' worker group: a ``replica_class`` process per replica of ``plan.pool`` on
    ``plan.backend``, each loading ``plan.engine`` and storing its finished groups in ``sample_dir``."""
    return create_worker_group(
        replica_class, plan.pool, plan.backend,
        args=(
            plan.engine, plan.model_path, plan.device, plan.pipeline.rollout_threads, sample_dir,
            plan.agent, plan.first_gpu,
        ),
    )  # fmt: skip


class ReplicaSet:
    """See the module docstring. ``trainer`` is the trainer worker group (it sends the weights);
    ``replica_class`` the worker each replica runs. With ``keep_in_store`` the replicas keep
    training rows (prompts ``prompt_width`` tokens wide, padded with ``pad_id``) in the data
    plane; ``restart_pause`` is what running requests do at a restart's sync; with
    ``log_directory`` (``pipeline.record_schedule``) each replica logs the groups it reports; with
    ``places`` each reads the prompts of the groups sent to it by place."""

    def __init__(
        self,
        plan: ReplicaPlan,
        trainer: Any,
        replica_class: type,
        keep_in_store: DataPlaneConfig | None,
        prompt_width: int,
        pad_id: int,
        restart_pause: str,
        log_directory: str | None,
        places: PromptPlaces | None = None,
    ) -> None:
        self.plan, self.pipeline, self.trainer = plan, plan.pipeline, trainer
        self.places = places
        self.replica_class = replica_class
        self.keep_in_store, self.prompt_width, self.pad_id = keep_in_store, prompt_width, pad_id
        self.restart_pause, self.log_directory = restart_pause, log_directory
        weights = self.pipeline.checkpoint_engine
        self.sample_dir = (weights.directory if weights.backend == "shared_memory" else "") or "/dev/shm"
        self.weights_dir = weights.directory or "/dev/shm"
        self.group: Any = None  # the replicas' worker group, from spawn() to close()
        self.fleet: RolloutFleet | None = None
        self.version = 0  # the weights the replicas hold (the rollout version)
        self.trainer_version = 0  # the trainer's newest weights, as far as the pipeline was told
        self.restarts = 0  # replicas restarted since start
        self.last_sync_gb_per_s = 0.0  # of the sync a restart made
        self._pending_sync: PendingSync | None = None  # sent; the replicas may still be loading it
        self._dead_pids: list[int] = []  # this host's replica processes lost and replaced

    # ------------------------------------------------------------------ lifecycle
    @property
    def size(self) -> int:
        return self.group.world_size

    @property
    def stored_directory(self) -> str:
        """Where the finished groups wait for the trainer (what ``pipeline.max_inflight_bytes`` bounds)."""
        return self.keep_in_store.directory if self.keep_in_store is not None else self.sample_dir

    def spawn(self) -> None:
        """Start the replicas and join them to the trainer's weight sender."""
        self.group = spawn_replicas(self.replica_class, self.plan, self.sample_dir)
        self._prepare(list(range(self.size)))
        connect_weight_sync(self.trainer, self.group, self.pipeline.checkpoint_engine)

    def drive(self, queue: SampleQueue) -> None:
        """Start the drivers that hand out groups and bring finished ones into ``queue``."""
        self.fleet = RolloutFleet(self.group, queue, self.pipeline.replica_timeout_s)

    def close(self, failed: bool = False) -> None:
        """Abort what is in flight, drop what is queued, stop the replicas and delete their stored
        samples (idempotent). After a failure (``failed``, or one a replica driver saw) the replicas
        are stopped without ceremony: the trainer may still be inside a weight sync that waits for a
        dead replica, so no call goes to it, and the files are deleted by name."""
        failed = failed or (self.fleet is not None and self.fleet.error is not None)
        if self.fleet is not None:
            self.fleet.close()
            self.fleet = None
        if self.group is None:
            return
        replica_pids = self.host_pids() + self._dead_pids
        try:
            if not failed:
                self.settle()
                self.trainer.close_weight_sender()
                self.group.close_engine()
        finally:
            self.group.shutdown()
            self.group = None
            for pid in replica_pids:
                discard_files_of(pid, self.sample_dir)
                if self.keep_in_store is not None:  # blocks of groups never trained (a lost replica's too)
                    discard_blocks_of(pid, self.keep_in_store.directory)
            if failed:
                for pid in _local_pids(self.trainer):
                    discard_files_of(pid, self.weights_dir, SLOT_PREFIX)

    def host_pids(self) -> list[int]:
        """The replicas' processes on this host."""
        return _local_pids(self.group) if self.group is not None else []

    # ------------------------------------------------------------------ calls on every replica
    def sync(self, version: int, pause: str) -> dict[str, float]:
        """Sync weights ``version`` to every replica (``pause``: what their running requests do);
        returns ``pipeline/weight_sync_s`` and ``pipeline/weight_sync_gbps``.

        A replica runs its calls in order, so every request started after this runs on the new
        weights; the next sync first waits until every replica has applied this one.
        """
        assert self.fleet is not None
        started = time.monotonic()
        try:
            with self.fleet.hold():
                self.settle()
                self._pending_sync = start_weight_sync(self.trainer, self.group, version, pause)
            self.version = version
            gb_per_s = self._pending_sync.stats.gb_per_s
        except RolloutReplicaError as error:
            if not self._restart_failed(error):
                raise
            gb_per_s = self.last_sync_gb_per_s  # the restart sent every replica the newest weights
        return {"pipeline/weight_sync_s": time.monotonic() - started, "pipeline/weight_sync_gbps": gb_per_s}

    def settle(self) -> None:
        """Wait until the replicas have applied the last sync (a failed replica raises, named)."""
        pending, self._pending_sync = self._pending_sync, None
        if pending is not None:
            pending.finish()

    def generate(self, requests: list[RolloutRequest]) -> list[Completion]:
        """``requests`` answered by the replicas, in order (validation), again after a restart."""
        assert self.fleet is not None
        fleet = self.fleet
        return self.recovering(lambda: fleet.generate(requests))

    def generate_to_store(self, prompts: Batch, seeds: list[int], sampling: SamplingParams) -> BatchRef:
        """A completion per row of ``prompts``, each under its own seed, kept in the replicas' data-plane
        blocks (``keep_in_store``): row ``i`` on replica ``i % size`` (as :meth:`generate` shares its
        requests), the references back in the rows' order; again after a restart."""
        assert self.fleet is not None
        fleet, rows = self.fleet, prompts.assign(non_tensors={"seed": list(seeds)})
        shares = [list(range(rank, len(rows), self.size)) for rank in range(self.size)]
        calls = [(rows[share], sampling) if share else None for share in shares]
        refs = self.recovering(lambda: fleet.on_each("generate_to_store", calls))
        joined = BatchRef.concat([ref for ref in refs if ref is not None])
        return joined.reorder(np.argsort([row for share in shares for row in share], kind="stable"))

    def generate_episodes(self, prompts: Batch, seeds: list[int], sampling: SamplingParams) -> Batch:
        """An agent episode per row of ``prompts``, each under its own seed (validation)."""
        assert self.fleet is not None
        with self.fleet.hold():
            return self.group.generate_episodes(
                prompts.assign(non_tensors={"seed": seeds}),
                sampling=sampling,
                prompt_width=max(len(p) for p in prompts["prompt_ids"]),
            )

    def agent_tool_totals(self) -> list[dict[str, tuple[int, int, float]]]:
        """Each replica's tool ``(calls, errors, seconds)`` since the last call."""

        def totals() -> list[dict[str, tuple[int, int, float]]]:
            assert self.fleet is not None
            with self.fleet.hold():
                return self.group.agent_tool_totals()

        return self.recovering(totals)

    def start_profile(self, directory: str) -> None:
        """Record the replicas with the PyTorch profiler; each writes ``<directory>/replica<N>.json``."""
        assert self.fleet is not None
        with self.fleet.hold():
            self.group.start_profile(directory)

    def stop_profile(self) -> list[str]:
        """Stop the replicas' recording; returns the trace paths."""
        assert self.fleet is not None
        with self.fleet.hold():
            return self.group.stop_profile()

    # ------------------------------------------------------------------ failures
    def check(self) -> None:
        """Raise a replica's failure (one that died while loading the last sync is named with
        it), or restart the replica when ``pipeline.replica_restarts`` allows."""
        assert self.fleet is not None
        try:
            self.fleet.check()
        except RolloutReplicaError as error:
            if self._restart_failed(error):
                return
            pending = self._pending_sync
            if pending is not None and pending.received.done():
                self.settle()  # raises, naming the weight version it failed to receive
            raise

    def recovering(self, call: Callable[[], Any]) -> Any:
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
        assert self.fleet is not None
        ranks = set(self.fleet.failures)
        if getattr(error, "rank", None) is not None:
            ranks.add(error.rank)  # type: ignore[attr-defined]
        if not ranks or self.restarts + len(ranks) > self.pipeline.replica_restarts:
            return False
        with self.fleet.hold():
            self._pending_sync = None  # abandoned: every replica receives the newest weights below
            before = set(self.host_pids())
            for rank in sorted(ranks):
                LOG.warning("rollout replica %d failed (%s); restarting it", rank, str(error).splitlines()[0])
                self.group.restart(rank)
            self._dead_pids.extend(before - set(self.host_pids()))
            self._rejoin_weight_sync(sorted(ranks))
        for rank in sorted(ranks):
            self.fleet.revive(rank)
        self.restarts += len(ranks)
        return True

    def _rejoin_weight_sync(self, restarted: list[int]) -> None:
        """Every replica joins a new weight sender and receives the trainer's newest weights."""
        self._prepare(restarted)
        self.group.disconnect_weights()
        self.trainer.close_weight_sender()
        connect_weight_sync(self.trainer, self.group, self.pipeline.checkpoint_engine)
        self._pending_sync = start_weight_sync(
            self.trainer, self.group, self.trainer_version, self.restart_pause
        )
        self.last_sync_gb_per_s = self._pending_sync.stats.gb_per_s
        self.settle()
        self.version = self.trainer_version

    # ------------------------------------------------------------------ where samples go
    def _prepare(self, ranks: list[int]) -> None:
        """Tell the new replicas ``ranks`` where their finished groups go and where they log them."""
        inline = [rank for rank in self._replicas_sending_inline() if rank in ranks]
        if inline:
            self.group.write_samples_inline(inline)
        if self.keep_in_store is not None:  # training rows of the run's fixed widths
            self.group.keep_samples_in_store(
                ranks, self.keep_in_store, self.prompt_width, self.plan.shape.sampling.max_tokens, self.pad_id
            )
        if self.log_directory is not None:  # the replicas keep what they report, for a replay
            self.group.log_samples(ranks, self.log_directory)
        if self.places is not None:  # prompt groups arrive by place
            self.group.read_prompts_by_place(ranks, self.places)

    def _replicas_sending_inline(self) -> list[int]:
        """The replicas whose samples travel with their metadata (``pipeline.sample_store``): none
        when they keep training rows in the data plane (``keep_in_store``), whose blocks replace the
        sample store whatever ``pipeline.sample_store`` says (:meth:`_check_blocks_reach_trainer`)."""
        everyone = list(range(self.size))
        if self.keep_in_store is not None:
            self._check_blocks_reach_trainer(everyone)
            return []
        if self.pipeline.sample_store == "inline":
            return everyone
        seen = self.group.ranks_seeing(self.sample_dir)
        blind = [rank for rank in everyone if rank not in seen]
        if blind and self.pipeline.sample_store == "shared_memory":
            raise ValueError(
                f"pipeline.sample_store=shared_memory, but rollout replica {blind[0]} cannot read files this "
                f"process writes in {self.sample_dir} (another host or container); use auto or inline"
            )
        return blind

    def _check_blocks_reach_trainer(self, ranks: list[int]) -> None:
        """The replicas ``ranks`` can hand their blocks to the trainer: with ``dataplane.engine=ray``
        from any node; with ``shm`` (files) only from this host."""
        assert self.keep_in_store is not None
        if self.keep_in_store.engine == "ray":
            return
        seen = self.group.ranks_seeing(self.keep_in_store.directory)
        blind = [rank for rank in ranks if rank not in seen]
        if blind:
            raise ValueError(
                f"dataplane.enabled=true keeps the samples in the replicas' {self.keep_in_store.directory}, "
                f"but rollout replica {blind[0]} cannot share files with this process (another host or "
                "container); set dataplane.engine=ray (Ray's object store, any node), or dataplane.enabled=false"
            )


def _local_pids(group: Any) -> list[int]:
    """The processes on this host that run ``group``'s workers."""
    return list(group.backend.host_pids)
