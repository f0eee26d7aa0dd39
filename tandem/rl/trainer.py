"""``RLTrainer``: the RL loop — it reads like the algorithm.

Each step: sample prompts -> generate ``n`` responses -> score them -> old (and reference)
log-probs -> advantages (on the controller; with the data plane, on the ranks from per-row
scalars) -> actor update in mini-batches -> sync the new weights into the rollout engines -> log
-> validate / checkpoint on schedule.

Every pipeline mode hands the step its prompt groups through one interface,
:class:`tandem.pipeline.source.BatchSource`: with ``pipeline.mode=sync`` the workers generate
each draw when it is asked for (colocated); the asynchronous modes generate on rollout replicas
while the trainer trains (:class:`tandem.pipeline.runner.AsyncRollout`).

What a step runs beyond that is its :class:`tandem.rl.step_plan.StepPlan`, built once from the
config: how the groups are collected (one draw, DAPO's dynamic sampling), what each draw is given
(ReMax's greedy baselines), the worker passes (old, reference and teacher log-probs, values) and
the update (policy gradient, online DPO's preference step). Those stages run on the trainer
whatever the source, so every algorithm runs in every pipeline mode.

Beside the loop, one module per concern: the worker groups it starts (:mod:`tandem.rl.worker_groups`),
its batch source (:mod:`tandem.rl.batch_source`), validation (:mod:`tandem.rl.validation`), what a
checkpoint holds (:mod:`tandem.rl.checkpoint_contents`) and the step's metrics
(:mod:`tandem.rl.step_metrics`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from tandem.algos import build_kl_controller
from tandem.config.paths import with_absolute_paths
from tandem.controller import check_placement
from tandem.dataplane import BatchRef
from tandem.engine.divergence import check_health, check_skipped_in_a_row
from tandem.models.gguf import with_gguf_resolved
from tandem.models.loading import load_tokenizer
from tandem.pipeline.source import BatchSource
from tandem.protocol import Batch
from tandem.report import RunInfo
from tandem.report.samples import append_val_samples
from tandem.report.tracker import ReportTracker
from tandem.rl.advantages import advantage_reads, step_advantages
from tandem.rl.batch_source import rl_batch_source
from tandem.rl.checkpoint_contents import load_checkpoint, resume_path, save_engines, trainer_state
from tandem.rl.config import TrainConfig
from tandem.rl.data import RLDataset, image_reader
from tandem.rl.metrics import timed, value_metrics
from tandem.rl.plan import run_plan
from tandem.rl.ref_advantages import advantages_stay_on_ranks, rank_advantages
from tandem.rl.rewards.sources import RewardSources
from tandem.rl.scoring import score_responses
from tandem.rl.step_data import step_data
from tandem.rl.step_metrics import reduced_worker_metrics, step_end_metrics
from tandem.rl.step_plan import build_step_plan
from tandem.rl.stream_forward import ForwardStream, stream_forward
from tandem.rl.validation import scored_validation, validation_metrics, validation_samples
from tandem.rl.worker_groups import start_worker_groups
from tandem.rollout.factory import check_engine_installed
from tandem.run.checkpoints import CheckpointManager
from tandem.run.leftovers import record_processes, remove_leftovers
from tandem.run.loop import RunRecord, Schedule, recording, run_steps
from tandem.run.output_dir import OutputDirLock, check_output_dir
from tandem.run.sampler import EpochSampler
from tandem.run.trackers import build_trackers


@dataclass
class RLResult:
    """Every logged step's metrics, the last validation metrics, and where the outputs went."""

    history: list[dict[str, float]]
    validation: dict[str, float]
    output_dir: Path
    hf_model_dir: Path | None
    report: Path | None


LOG = logging.getLogger(__name__)

PLACEMENT_KEYS = (  # what shapes the pools of config.resource_pools(), named when they cannot be placed
    "trainer.nnodes, trainer.n_gpus_per_node (or trainer.n_workers), critic.placement, reward.model.n_workers "
    "and pipeline.rollout_replicas (over pipeline.rollout_nodes)"
)


class RLTrainer:
    """Runs :class:`TrainConfig` end to end (see the module docstring)."""

    def __init__(self, config: TrainConfig, console: Console | None = None) -> None:
        config = with_absolute_paths(config)  # its path fields: workers may run elsewhere (Ray)
        config = with_gguf_resolved(config)  # a GGUF model converted once, before the workers
        self.config = config
        self.console = console or Console()
        self.output_dir = check_output_dir(config.trainer.output_dir, "trainer.output_dir")
        data = config.data
        self.tokenizer = load_tokenizer(config.model_path)
        images = image_reader(config.model_path, data)  # a vision-language model's processor, loaded once
        self.train_data = RLDataset.load(
            data.train_path,
            self.tokenizer,
            data.max_prompt_length,
            data.overlong_prompts,
            images,
            data.special_tokens_in_text,
        )
        self.val_data = (
            RLDataset.load(
                data.val_path,
                self.tokenizer,
                data.max_prompt_length,
                data.overlong_prompts,
                images,
                data.special_tokens_in_text,
            )
            if data.val_path
            else None
        )
        self.rewards = RewardSources(config.reward)
        self.rewards.check_sources([s.data_source for s in self.train_data.samples])
        if self.val_data is not None:
            self.rewards.check_sources([s.data_source for s in self.val_data.samples])
        self.train_data.check_fills_batch(data.train_batch_size, "data.train_path")
        steps_per_epoch = len(self.train_data) // data.train_batch_size
        self.total_steps = config.trainer.total_steps or steps_per_epoch * config.trainer.total_epochs
        self.sampler = EpochSampler(len(self.train_data), config.trainer.seed, data.shuffle)
        self.kl_controller = build_kl_controller(config.algorithm.kl)
        self.checkpoints = CheckpointManager(self.output_dir / "checkpoints", config.trainer.keep_last)
        self.step = 0
        self.record: RunRecord | None = None  # what the run logged, once it runs
        self.run_info = RunInfo(
            self.output_dir,
            trainer=f"RL: {config.algorithm.adv_estimator} advantages, {config.actor.policy_loss.name} policy loss",
            experiment=config.trainer.experiment,
            project=config.trainer.project,
            config=dataclasses.asdict(config),
            model_path=config.model_path,
            data_files={"train": data.train_path, "val": data.val_path},
            total_steps=self.total_steps,
        )
        self.plan = build_step_plan(config)  # the step's stages (tandem.rl.stages)
        for stage in self.plan.stages():
            if stage.check is not None:
                stage.check(self)  # a stage's own settings, before any model loads
        self.rollout: BatchSource | None = None  # built with the workers
        self.stream: ForwardStream | None = None  # the passes on draws' chunks (pipeline.stream_forward)
        self._step_draws: list[BatchRef] = []  # the step's stored draws, released should it fail
        self.critics = None  # the critic's worker group, when the estimator reads values
        self.teachers = None  # the teacher's ranks, when the run distils

    # ------------------------------------------------------------------ the loop
    def fit(self) -> RLResult:
        """Train for ``total_steps`` steps; returns the metrics history and output locations.

        The run holds ``trainer.output_dir`` for its duration: a second run there is refused.
        """
        with OutputDirLock(self.output_dir, "trainer.output_dir"):
            return self._fit()

    def _fit(self) -> RLResult:
        config, trainer = self.config, self.config.trainer
        check_placement(
            config.resource_pools(),
            trainer.backend,
            PLACEMENT_KEYS,
            device=("trainer.device", trainer.device),
        )
        if trainer.backend != "ray":  # Ray's nodes may have packages the controller's host lacks
            check_engine_installed(config.rollout.engine.name)
        removed = remove_leftovers(self.output_dir)
        if removed:
            self.console.print(f"removed {removed} shared-memory file(s) left by an interrupted run here")
        with contextlib.ExitStack() as groups:
            params = self._start_workers(groups)
            resumed = self._resume()
            self._print_plan(params)
            trackers, report = self._trackers(resumed)
            failed = True  # until the loop ends normally: the pipeline then closes without ceremony
            try:
                with recording(self.run_info, trackers, self.step, self.console) as self.record:
                    self.rollout = rl_batch_source(
                        self.config,
                        self.workers,
                        self.train_data,
                        self.sampler,
                        self.tokenizer,
                        self.val_data,
                    )
                    self.rollout.start(self.step)
                    self.stream = stream_forward(self)
                    self._record_processes()
                    run_steps(self, self._schedule(), self.record, self._profiled)
                failed = False
            finally:
                if self.rollout is not None:
                    self.rollout.close(failed)
            hf_dir = None
            if trainer.export_hf:
                hf_dir = self.output_dir / "hf_model"
                self.workers.export_hf(str(hf_dir))
            self.workers.shutdown_engines()
        if report is not None:
            self.console.print(f"report: {report.path}")
        record = self.record
        return RLResult(record.history, record.validation, self.output_dir, hf_dir, report and report.path)

    def _start_workers(self, groups: contextlib.ExitStack) -> int:
        """Start the run's worker groups (:func:`tandem.rl.worker_groups.start_worker_groups`), all
        closed with ``groups``; returns the policy's parameter count."""
        started = start_worker_groups(
            self.config, self.total_steps, self.output_dir, self.rewards, groups, self.console
        )
        self.workers, self.critics, self.teachers = started.workers, started.critics, started.teachers
        return started.params

    def _trackers(self, resumed: bool) -> tuple[list, ReportTracker | None]:
        """The trackers ``trainer.loggers`` names, and the report (after the JSONL tracker, whose
        file it draws) unless ``trainer.report`` is off."""
        config, trainer = self.config, self.config.trainer
        trackers = build_trackers(
            trainer.loggers, self.output_dir, self.total_steps, self.step, resumed,
            trainer.project, trainer.experiment, _flatten(dataclasses.asdict(config)), self.console,
        )  # fmt: skip
        report = None
        if trainer.report and "jsonl" in trainer.loggers:
            report = ReportTracker(self.output_dir, trainer.report_every)
            trackers.append(report)
        return trackers, report

    def _record_processes(self) -> None:
        """Note this host's processes of the run, so that a run after a ``kill -9`` here removes
        the shared-memory files they leave (:mod:`tandem.run.leftovers`)."""
        groups = [
            g for g in (self.workers, self.critics, self.teachers, self.rewards.model_group) if g is not None
        ]
        pids = [os.getpid(), *self.rollout.host_pids(), *(pid for g in groups for pid in g.backend.host_pids)]
        directory = self.config.pipeline.checkpoint_engine.directory
        record_processes(self.output_dir, pids, ["/dev/shm", *([directory] if directory else [])])

    def _schedule(self) -> Schedule:
        """Validate first (unless resumed) and every ``trainer.val_every`` steps, save every
        ``trainer.save_every`` steps, and both after the last step."""
        trainer = self.config.trainer
        return Schedule(
            total_steps=self.total_steps,
            validate_every=trainer.val_every,
            save_every=trainer.save_every,
            validates=self.val_data is not None,
            validate_first=trainer.val_before_train,
        )

    def train_step(self) -> dict[str, float]:
        """One RL step, the plan's stages; returns its metrics."""
        self.step += 1
        timings: dict[str, float] = {}
        self._step_draws = []
        with timed(timings, "step"):
            try:
                batch, metrics = self.collect_batch(timings)
                batch, update_metrics = self.plan.update(self, batch, timings)
            except BaseException:
                self._release_failed_step()
                raise
            metrics.update(update_metrics)
            metrics["actor/max_abs_weight"] = self.check_divergence(metrics)
            with timed(timings, "update_weights"):
                metrics.update(self.rollout.after_update(self.step))
        metrics.update(
            step_end_metrics(
                batch, self.workers.memory_metrics(), self.rollout.agent_tool_totals, timings,
                self.config.rollout.max_response_length, self.config.world_size, self.sampler.epoch,
            )
        )  # fmt: skip
        return metrics

    def _release_failed_step(self) -> None:
        """A step failed: release the blocks of its draws and streamed outputs (with in-process
        workers nothing else would: they are the controller's own files). A release that fails
        too is logged, never raised over the step's error."""
        try:
            for draw in self._step_draws:
                self.workers.release_refs(draw)
            if self.stream is not None:
                self.stream.discard()
        except Exception:  # noqa: BLE001 (the step's own error is the one to raise)
            LOG.warning("could not release the failed step's stored draws", exc_info=True)

    def _policy_gradient_update(
        self, batch: Batch, timings: dict[str, float]
    ) -> tuple[Batch, dict[str, float]]:
        """The policy-gradient update (:mod:`tandem.rl.stages.policy_gradient`): the plan's prepare
        stages, its passes over the step's data (a ``Batch`` or the data plane's references:
        :mod:`tandem.rl.step_data`), its view stages, the advantages, then the updates."""
        config, plan = self.config, self.plan
        for stage in plan.prepares:
            batch = stage(self, batch)
        streamed = self.stream.outputs_for(batch, timings) if self.stream is not None else None
        data = step_data(batch, config.dataplane, config.dataplane.enabled, self.workers, streamed)
        try:
            for stage in plan.passes:
                stage(self, data, timings)
            hooked = type(self).compute_advantages is not RLTrainer.compute_advantages
            if advantages_stay_on_ranks(data, plan, config.algorithm, hooked):  # per-row scalars here
                with timed(timings, "adv"):
                    view, adv_metrics, step = rank_advantages(
                        data, self.workers, config.algorithm, self.kl_controller
                    )
            else:
                view = data.view(advantage_reads(config.algorithm))
                for stage in plan.views:
                    view = stage(self, view)
                with timed(timings, "adv"):
                    view, adv_metrics = self.compute_advantages(view)
                step = data.for_updates(view)
            metrics = self._updates(step, view, timings)
        finally:
            data.release()
        return view, {**metrics, **adv_metrics}  # the controller's measures win over the workers' ones

    def _updates(self, step: Any, view: Batch, timings: dict[str, float]) -> dict[str, float]:
        """The critic's and the actor's updates on ``step`` (a ``Batch`` or ``BatchRef``); ``view``
        is the controller's batch of the step, for the value metrics."""
        metrics: dict[str, float] = {}
        if self.critics is not None:
            with timed(timings, "update_critic"):
                per_worker = self.critics.update_critic(step)
            metrics.update(reduced_worker_metrics(per_worker))
            if "values" in view:  # else the advantages on the ranks measured them (tandem.rl.ref_advantages)
                metrics.update(value_metrics(view))
        if self.step > self.config.critic.warmup_steps or self.critics is None:
            with timed(timings, "update_actor"):
                metrics.update(self.update_actor(step))
        return metrics

    def update_actor(self, batch: Any) -> dict[str, float]:
        """The actor's update on ``batch`` (a ``Batch`` or ``BatchRef``), its metrics reduced over the workers."""
        return reduced_worker_metrics(self.workers.update_actor(batch, step=self.step))

    # ------------------------------------------------------------------ stages
    def collect_batch(self, timings: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        """The step's ``train_batch_size`` scored prompt groups, as the plan's collect stage gathers
        them from :meth:`scored_draw` (one draw, or DAPO's dynamic sampling)."""
        return self.plan.collect(self, timings)

    def scored_draw(
        self, draw: int, timings: dict[str, float]
    ) -> tuple[Batch, dict[str, float], dict[str, float]]:
        """The step's ``draw``-th draw from the batch source, scored and given the plan's draw
        stages (ReMax's greedy baselines); with the draw's and the scoring's metrics. The ``gen``
        time is the generation (sync) or the wait for finished groups (asynchronous modes)."""
        with timed(timings, "gen"):
            generated, draw_metrics = self.rollout.next_batch(self.step, draw)
        if isinstance(generated, BatchRef):
            self._step_draws.append(generated)
        with timed(timings, "reward"):
            scored, reward_metrics = self.score(generated)
        for stage in self.plan.draws:
            scored = stage(self, scored, timings)
        return scored, draw_metrics, reward_metrics

    def generate(
        self, prompts: Batch, seeds: list[int], temperature: float, validation: bool = False
    ) -> Batch:
        """Responses for each row of ``prompts`` (one request per row), trimmed to the longest;
        ``validation`` samples with the validation top-p/top-k."""
        sampling = self.config.rollout.sampling(temperature, validation=validation)
        return self.rollout.generate(prompts, seeds, sampling, self.step)

    def score(self, batch: Batch, training: bool = True) -> tuple[Batch, dict[str, float]]:
        """The batch scored by the run's reward sources (:func:`tandem.rl.scoring.score_responses`);
        in training also ``reward_components`` when the advantage estimator reads them."""
        keys = self.config.algorithm.reward_component_keys if training else ()
        return score_responses(
            batch, self.rewards, self.tokenizer, self.config.rollout.max_response_length, keys, self.console
        )

    def compute_advantages(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """KL penalty (if any), rollout correction, and the configured advantage estimator."""
        return step_advantages(batch, self.config.algorithm, self.kl_controller)

    def check_divergence(self, update_metrics: dict[str, float]) -> float:
        """Stop (:class:`DivergenceError`, naming the step) when too many optimizer steps in a row
        were skipped or the updated actor's (or critic's) weights or outputs are not finite, before
        the weights reach the rollout engine or a checkpoint. Returns the actor's largest weight."""
        trainer = self.config.trainer
        for role in ("actor", "critic"):
            check_skipped_in_a_row(
                int(update_metrics.get(f"{role}/skipped_updates_in_a_row", 0)), trainer.max_skipped_updates_in_a_row,
                "trainer.max_skipped_updates_in_a_row", self.step,
            )  # fmt: skip
        if self.critics is not None:
            check_health(self.critics.critic_health(), self.step, self.checkpoints.latest, "critic", "values")
        return check_health(self.workers.actor_health(), self.step, self.checkpoints.latest)

    def validate(self) -> dict[str, float]:
        """Accuracy on the validation prompts per data source: ``val-core/<source>/acc/mean@<n>``
        (:mod:`tandem.rl.validation`); the first prompts' responses go to ``val_samples.jsonl``."""
        assert self.val_data is not None
        rollout = self.config.rollout
        scored, texts = scored_validation(self)  # stored on the ranks or replicas with the data plane
        if self.config.agent.enabled:  # the validation episodes' tool calls are not the next step's
            self.rollout.agent_tool_totals()
        metrics = validation_metrics(scored, rollout.val_n)
        samples = validation_samples(scored, texts, self.val_data, self.tokenizer, rollout.val_n)
        append_val_samples(self.output_dir, self.step, samples)
        return metrics

    # ------------------------------------------------------------------ checkpoints and logging
    def save_checkpoint(self) -> Path:
        """Save the step's checkpoint (:mod:`tandem.rl.checkpoint_contents`); returns its directory."""
        state = trainer_state(self.step, self.sampler, self.kl_controller)
        path = self.checkpoints.save(
            self.step, state, lambda directory: save_engines(directory, self.workers, self.critics)
        )
        self.console.print(f"checkpoint: {path}")
        return path

    def _resume(self) -> bool:
        """Load the checkpoint ``trainer.resume`` names, if any; returns whether the run resumed."""
        path = resume_path(self.config.trainer.resume, self.checkpoints, self._warn)
        if path is None:
            return False
        self.step = load_checkpoint(path, self.workers, self.critics, self.sampler, self.kl_controller)
        self.console.print(f"resumed from {path} (step {self.step})")
        return True

    def _warn(self, message: str) -> None:
        self.console.print(f"[yellow]warning: {escape(message)}", highlight=False)

    @contextlib.contextmanager
    def _profiled(self, step: int) -> Iterator[None]:
        """Record step ``step`` with the PyTorch profiler on every trainer worker and rollout
        replica when it is one of ``trainer.profile_steps`` (one Chrome trace per process)."""
        trainer = self.config.trainer
        if step not in trainer.profile_steps:
            yield
            return
        directory = Path(trainer.profile_dir or self.output_dir / "profile") / f"step_{step}"
        self.workers.start_profile(str(directory))
        self.rollout.start_profile(str(directory))
        try:
            yield
        finally:
            paths = self.workers.stop_profile() + self.rollout.stop_profile()
            self.console.print(f"profile of step {step}: {', '.join(paths)}")

    def _print_plan(self, params: int) -> None:
        val_prompts = len(self.val_data) if self.val_data else 0
        self.console.print(
            run_plan(
                self.config, self.plan, params, self.train_data, val_prompts, self.total_steps, self.step
            )
        )


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): tree}
