"""``PipelineConfig``: how generation and training overlap (``pipeline.*``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tandem.checkpoint_engine import CheckpointEngineConfig
from tandem.config.paths import INPUT_PATH, OUTPUT_PATH, path_field
from tandem.config.validation import check_choice, check_positive, check_range

MODES = ("sync", "one_step_off", "fully_async")
OLD_LOG_PROBS = ("recompute", "rollout")
SAMPLE_STORES = ("auto", "shared_memory", "inline")


def _shared_memory() -> CheckpointEngineConfig:
    return CheckpointEngineConfig(backend="shared_memory", bucket_mb=64)


@dataclass(frozen=True)
class PipelineConfig:
    """The RL pipeline (see docs/pipelines.md).

    Attributes:
        mode: ``sync`` (colocated: generate, then train, in the same workers), ``one_step_off``
            (rollout replicas generate batch k+1 with weights k-1 while the trainer trains on
            batch k) or ``fully_async`` (replicas generate continuously; the trainer takes
            prompt groups as they finish).
        staleness_threshold: ``fully_async``: the most weight versions a trained sample may lag
            the trainer (its oldest token's version against the trainer's). The rollout stops
            starting prompt groups that could only be trained later than that, and groups that
            still end up older are dropped and counted (``pipeline/dropped_stale``).
        partial_rollout: ``fully_async``: a weight update interrupts requests in flight, which go
            on under the new weights (each token keeps the version it was sampled under); off:
            the update waits for the running requests to finish first.
        trigger_parameter_sync_step: ``fully_async``: trainer steps between weight syncs.
        rollout_replicas: rollout engines, one process each, apart from the trainer's workers.
        rollout_nodes: the nodes the replicas are split over, ``rollout_replicas / rollout_nodes``
            on each (verl's fully-async recipe calls it ``rollout.nnodes``). Each node's replicas
            are one bundle of the rollout pool's Ray placement group, each bundle on a node of
            its own; more than one needs ``trainer.backend=ray``. 1 (default): all on one node.
        trainer_threads / rollout_threads: CPU threads for each trainer worker / rollout replica
            (0: PyTorch's default). On a CPU machine give each side its share of the cores.
        checkpoint_engine: how weights reach the replicas (``pipeline.checkpoint_engine.backend``
            and its settings; see docs/checkpoint_engine.md).
        sample_store: where finished prompt groups' tensors wait for the trainer:
            ``shared_memory`` (files in the replica's ``/dev/shm``; only metadata reaches the
            controller, which maps the files), ``inline`` (the tensors travel with the metadata,
            through the process pipe or Ray's object store: for replicas on other hosts) or
            ``auto`` (shared memory for the replicas that see the controller's ``/dev/shm``,
            inline for the others). With ``dataplane.enabled=true``, where the draws stay in the
            replicas' data-plane blocks (:func:`tandem.rl.step_data.rollout_stays_in_store`), the
            blocks replace the sample store whatever this says: with ``dataplane.engine=ray`` they
            reach the trainer from any host, with ``shm`` a replica on another host is an error
            naming ``dataplane.engine``. Where the draws are not stored (a plan stage that does not
            take stored draws) this says how the samples travel, as with the data plane off.
        max_inflight_bytes: the most bytes of finished prompt groups that may wait in the sample
            store for the trainer (queued, not yet taken by a step), split evenly over the
            replicas. A replica whose share is full stores nothing more and starts no new group:
            its finished groups wait in its own memory (never dropped) until the trainer takes
            queued ones (``pipeline/inflight_bytes_max``, ``pipeline/rollout_wait_s``). A group
            larger than a replica's whole share is stored when that replica has nothing queued.
            0 (default): half the free space of the sample directory (``/dev/shm``) when the
            pipeline starts, leaving the rest to the weight buckets, the data plane's blocks and
            the step being assembled.
        replica_timeout_s: a replica that does not answer a call for this long is reported as hung.
        replica_restarts: how many times in a run a rollout replica that died, hung or failed is
            replaced by a fresh process instead of ending the run: the new one (and every other
            replica) receives the trainer's current weights, and the prompt groups the lost one
            held are generated again (``pipeline/replica_restarts`` counts them). 0: the first
            failure ends the run, naming the replica.
        old_log_probs: where PPO's old log-probs come from in the asynchronous modes:
            ``recompute`` (a forward with the trainer's current weights, which then act as the
            proximal policy; ``algorithm.rollout_correction.*`` weighs the samples against the
            rollout's log-probs) or ``rollout`` (the log-probs the rollout sampled with: the
            behaviour policy itself, one trainer forward fewer per step; needs rollout.top_p=1
            and rollout.top_k=0, since truncated sampling changes them). With
            ``dataplane.enabled=true`` the draws stay in the replicas' blocks either way: the
            stored ``rollout_log_probs`` are read as ``old_log_probs`` (``BatchRef.alias``).
        record_schedule: ``one_step_off`` / ``fully_async``: a JSONL file (made absolute where the
            run starts) to which every draw appends, before its step trains, which prompt groups it
            holds and where each came from: replica and restart generation, seeds, request ids,
            weight versions (:mod:`tandem.pipeline.schedule_record`); the replicas also keep each
            group they report in a sample log beside it (:mod:`tandem.pipeline.sample_log`).
            Empty (default): none.
        replay: a schedule record written by ``pipeline.record_schedule`` (with its sample log
            beside it): the run trains each step on the groups that step of the recorded run
            trained on, read from the log in the recorded order (:mod:`tandem.pipeline.replay`);
            no replica runs and no weights are synced. The run's ``pipeline.mode`` and the settings
            the record holds (batch shape, seed, algorithm, model) must be the recorded run's.
            Empty (default): generate.
        stream_forward: ``one_step_off`` / ``fully_async`` with ``dataplane.enabled``: the step's
            forward-only passes (old and reference log-probs, the critic's values) run on the
            draw's prompt groups in chunks as they arrive, while the rest are still generating,
            instead of on the whole draw once it is complete (docs/data-plane.md); refused for a
            step that reorders or filters the draw's rows first (``trainer.balance_batch`` with
            more than one actor rank, ``algorithm.filter_groups.enable``). Off (default): the passes
            wait for the whole draw.
        stream_forward_groups: prompt groups per chunk with ``stream_forward``; 0 (default): enough
            for one micro-batch per actor rank (``actor.engine.micro_batch_size`` rows, or with
            packing ``max_tokens_per_micro_batch`` over the longest sequence, per rank).
    """

    mode: str = "sync"
    staleness_threshold: int = 1
    partial_rollout: bool = True
    trigger_parameter_sync_step: int = 1
    rollout_replicas: int = 1
    rollout_nodes: int = 1
    trainer_threads: int = 0
    rollout_threads: int = 0
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=_shared_memory)
    sample_store: str = "auto"
    max_inflight_bytes: int = 0
    replica_timeout_s: float = 30.0
    replica_restarts: int = 0
    old_log_probs: str = "recompute"
    record_schedule: str = path_field(OUTPUT_PATH)
    replay: str = path_field(INPUT_PATH)
    stream_forward: bool = False
    stream_forward_groups: int = 0

    def __post_init__(self) -> None:
        check_choice("pipeline", "mode", self.mode, MODES)
        check_range("pipeline", "staleness_threshold", self.staleness_threshold, low=0)
        check_positive("pipeline", "trigger_parameter_sync_step", self.trigger_parameter_sync_step)
        check_positive("pipeline", "rollout_replicas", self.rollout_replicas)
        self._check_rollout_nodes()
        check_range("pipeline", "trainer_threads", self.trainer_threads, low=0)
        check_range("pipeline", "rollout_threads", self.rollout_threads, low=0)
        check_positive("pipeline", "replica_timeout_s", self.replica_timeout_s)
        check_range("pipeline", "replica_restarts", self.replica_restarts, low=0)
        check_choice("pipeline", "old_log_probs", self.old_log_probs, OLD_LOG_PROBS)
        check_choice("pipeline", "sample_store", self.sample_store, SAMPLE_STORES)
        if not isinstance(self.max_inflight_bytes, int) or isinstance(self.max_inflight_bytes, bool):
            raise ValueError(
                f"pipeline.max_inflight_bytes must be a whole number of bytes (0: half the free "
                f"space of /dev/shm), got {self.max_inflight_bytes!r}"
            )
        check_range("pipeline", "max_inflight_bytes", self.max_inflight_bytes, low=0)
        if self.record_schedule and self.mode == "sync":
            raise ValueError(
                "pipeline.record_schedule records the asynchronous modes' schedule; pipeline.mode=sync "
                "trains each step on the draw its seed decides (set pipeline.mode=one_step_off or "
                "fully_async, or leave pipeline.record_schedule empty)"
            )
        if self.replay:
            self._check_replay()
        check_range("pipeline", "stream_forward_groups", self.stream_forward_groups, low=0)
        if self.stream_forward and (self.mode == "sync" or self.replay):
            raise ValueError(
                f"pipeline.stream_forward streams the rollout replicas' groups to the trainer as they "
                f"finish; pipeline.mode={self.mode}{' with pipeline.replay' if self.replay else ''} has "
                "none (set pipeline.mode=one_step_off or fully_async, without pipeline.replay)"
            )
        if self.mode != "sync" and self.checkpoint_engine.backend == "naive":
            raise ValueError(
                f"pipeline.mode={self.mode} puts the rollout in other processes; pipeline.checkpoint_engine.backend "
                "must be broadcast, shared_memory or files (naive is an in-process copy)"
            )

    def _check_rollout_nodes(self) -> None:
        """``pipeline.rollout_nodes`` is positive, splits the replicas evenly and has replicas to split."""
        check_positive("pipeline", "rollout_nodes", self.rollout_nodes)
        if self.rollout_replicas % self.rollout_nodes:
            raise ValueError(
                f"pipeline.rollout_replicas={self.rollout_replicas} must divide evenly over "
                f"pipeline.rollout_nodes={self.rollout_nodes} (the same number of replicas on each node)"
            )
        if self.rollout_nodes > 1 and self.mode == "sync":
            raise ValueError(
                f"pipeline.rollout_nodes={self.rollout_nodes} spreads rollout replicas, and pipeline.mode=sync "
                "has none (it generates in the trainer's workers); set pipeline.mode=one_step_off or "
                "fully_async, or pipeline.rollout_nodes=1"
            )

    def _check_replay(self) -> None:
        """``pipeline.replay`` names an existing record, of an asynchronous mode, and records nothing."""
        if not os.path.isfile(self.replay):
            raise ValueError(
                f"pipeline.replay={self.replay}: no such file (a schedule record written by "
                "pipeline.record_schedule=PATH)"
            )
        if self.mode == "sync":
            raise ValueError(
                "pipeline.replay replays an asynchronous run; set pipeline.mode to the recorded run's "
                "(one_step_off or fully_async), not sync"
            )
        if self.record_schedule:
            raise ValueError(
                "pipeline.replay trains on a recorded schedule and pipeline.record_schedule would record a "
                "new one: set only one of them"
            )

    @property
    def disaggregated(self) -> bool:
        """Rollout replicas run apart from the trainer (every mode but ``sync``)."""
        return self.mode != "sync"
