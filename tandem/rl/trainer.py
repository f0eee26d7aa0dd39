"""``RLTrainer``: the RL loop — it reads like the algorithm.

Each step: sample prompts -> generate ``n`` responses -> score them -> old (and reference)
log-probs -> advantages on the controller -> actor update in mini-batches -> sync the new
weights into the rollout engines -> log -> validate / checkpoint on schedule.

Every pipeline mode hands the step its prompt groups through one interface,
:class:`tandem.pipeline.source.BatchSource`: with ``pipeline.mode=sync`` the workers generate
each draw when it is asked for (colocated); the asynchronous modes generate on rollout replicas
while the trainer trains (:class:`tandem.pipeline.runner.AsyncRollout`). The stages over a
step's groups (scoring, ReMax's greedy baselines, DAPO's dynamic sampling) run on the trainer
whatever the source.

Beside the loop, one module per concern: the worker groups it starts (:mod:`tandem.rl.worker_groups`),
its batch source (:mod:`tandem.rl.batch_source`), validation (:mod:`tandem.rl.validation`), what a
checkpoint holds (:mod:`tandem.rl.checkpoint_contents`) and the step's metrics
(:mod:`tandem.rl.step_metrics`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from tandem.algos import build_kl_controller
from tandem.config.paths import with_absolute_paths
from tandem.controller import check_placement
from tandem.engine.divergence import check_health, check_skipped_in_a_row
from tandem.models.gguf import with_gguf_resolved
from tandem.models.loading import load_tokenizer
from tandem.pipeline.source import BatchSource, merge_draw_metrics
from tandem.protocol import Batch
from tandem.protocol.sequences import concat_sequences, sequence_lengths, trim_padding
from tandem.report import RunInfo
from tandem.report.samples import append_val_samples
from tandem.report.tracker import ReportTracker
from tandem.rl.advantages import advantage_reads, step_advantages
from tandem.rl.balance import balanced_order
from tandem.rl.batch_source import rl_batch_source
from tandem.rl.checkpoint_contents import load_checkpoint, resume_path, save_engines, trainer_state
from tandem.rl.config import TrainConfig
from tandem.rl.data import RLDataset, image_reader
from tandem.rl.dataset_responses import OFF_POLICY
from tandem.rl.metrics import timed, value_metrics
from tandem.rl.plan import run_plan
from tandem.rl.preference_pairs import best_worst_pairs, with_reference_sums
from tandem.rl.rewards.sources import RewardSources
from tandem.rl.scoring import score_responses
from tandem.rl.step_data import step_data
from tandem.rl.step_metrics import reduced_worker_metrics, step_end_metrics
from tandem.rl.teacher_worker import check_same_tokenizer, shared_vocabulary
from tandem.rl.validation import validation_metrics, validation_prompts, validation_samples
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


PLACEMENT_KEYS = (  # what shapes the pools of config.resource_pools(), named when they cannot be placed
    "trainer.nnodes, trainer.n_gpus_per_node (or trainer.n_workers), critic.placement, reward.model.n_workers "
    "and pipeline.rollout_replicas"
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
        if config.distills:
            check_same_tokenizer(
                load_tokenizer(config.teacher.model_path), config.teacher.model_path,
                self.tokenizer, config.model_path,
            )  # fmt: skip
            shared_vocabulary(config)  # refuses a teacher.top_k past the vocabulary, before any model loads
        self.rollout: BatchSource | None = None  # built with the workers
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
                        self.config, self.workers, self.train_data, self.sampler, self.tokenizer
                    )
                    self.rollout.start(self.step)
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
        """One RL step; returns its metrics."""
        self.step += 1
        timings: dict[str, float] = {}
        with timed(timings, "step"):
            batch, metrics = self.collect_batch(timings)
            update = self._preference_update if self.config.prefers else self._policy_gradient_update
            batch, update_metrics = update(batch, timings)
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

    def _policy_gradient_update(
        self, batch: Batch, timings: dict[str, float]
    ) -> tuple[Batch, dict[str, float]]:
        """Old and reference log-probs, advantages, then the actor's PPO-style update."""
        if self.config.trainer.balance_batch and self.config.actor_dp_size > 1:
            order = balanced_order(
                sequence_lengths(batch).tolist(), self.config.rollout.n, self.config.actor_dp_size
            )
            batch = batch.reorder(order)
        config = self.config
        off_policy = OFF_POLICY in batch and bool(batch[OFF_POLICY][0])  # the dataset's responses
        if config.old_log_probs_from_rollout and not off_policy:
            batch = batch.assign(tensors={"old_log_probs": batch["rollout_log_probs"]})
        data = step_data(batch, config.dataplane, config.dataplane.enabled, self.workers)
        try:
            if off_policy or not (config.old_log_probs_from_rollout or config.old_log_probs_from_update):
                with timed(timings, "old_log_prob"):
                    data.stage(self.workers, self.workers.compute_log_prob)
            if config.needs_reference:
                with timed(timings, "ref"):
                    data.stage(self.workers, self.workers.compute_ref_log_prob)
            if self.teachers is not None:
                with timed(timings, "teacher"):
                    data.stage(self.teachers, self.teachers.compute_teacher_log_prob)
            if self.critics is not None:
                with timed(timings, "values"):
                    data.stage(self.critics, self.critics.compute_values)
            view = data.view(advantage_reads(config.algorithm))
            if off_policy:  # no rollout sampled them: their rollout log-probs are the policy's
                view = view.assign(tensors={"rollout_log_probs": view["old_log_probs"]})
            with timed(timings, "adv"):
                view, adv_metrics = self.compute_advantages(view)
            metrics = self._updates(data.for_updates(view), view, timings)
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
            metrics.update(value_metrics(view))
        if self.step > self.config.critic.warmup_steps or self.critics is None:
            with timed(timings, "update_actor"):
                metrics.update(self._update_actor(step))
        return metrics

    def _preference_update(self, batch: Batch, timings: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        """Online DPO: each prompt's best and worst response form a pair; reference log-probs of
        the pairs; one preference-loss step. Returns the whole scored batch (for its statistics)."""
        batch = batch.assign(
            tensors={"token_level_rewards": batch["token_level_scores"]}
        )  # no KL in the reward
        with timed(timings, "adv"):
            pairs, metrics = best_worst_pairs(batch, self.config.rollout.n, self.config.actor_dp_size)
        if pairs is None:  # no prompt scored its responses differently: nothing to prefer
            self.console.print(f"[yellow]step {self.step}: no prompt group has a preference; update skipped")
            return batch, metrics
        if self.config.needs_reference:
            with timed(timings, "ref"):
                pairs = with_reference_sums(pairs.union(self.workers.compute_ref_log_prob(pairs)))
        with timed(timings, "update_actor"):
            metrics.update(self._update_actor(pairs))
        return batch, metrics

    def _update_actor(self, batch: Batch) -> dict[str, float]:
        return reduced_worker_metrics(self.workers.update_actor(batch, step=self.step))

    # ------------------------------------------------------------------ stages
    def collect_batch(self, timings: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        """The step's ``train_batch_size`` scored prompt groups from the batch source.

        Each draw is scored and, when the estimator reads greedy baselines (ReMax), given them.
        With DAPO's dynamic sampling the step draws again until enough groups carry a signal
        (their rewards differ) or ``max_num_gen_batches`` draws are spent; it then tops up with
        uninformative groups, which add no gradient. The ``gen`` time is the generation (sync) or
        the wait for finished groups (asynchronous modes)."""
        config = self.config
        wanted, n = config.data.train_batch_size, config.rollout.n
        dynamic = config.algorithm.filter_groups
        kept: list[Batch] = []
        spare: list[Batch] = []
        metrics: dict[str, float] = {}
        draw = 0
        while True:
            draw += 1
            with timed(timings, "gen"):
                generated, draw_metrics = self.rollout.next_batch(self.step, draw)
            metrics = merge_draw_metrics(metrics, draw_metrics)
            with timed(timings, "reward"):
                scored, reward_metrics = self.score(generated)
            if config.algorithm.needs_greedy_baseline:
                with timed(timings, "gen_greedy"):
                    scored = self.with_greedy_baselines(scored)
            if not dynamic.enable:
                return scored, {**metrics, **reward_metrics}
            informative = _groups_with_spread(scored, n, dynamic.metric)
            kept.append(scored[informative.repeat_interleave(n).nonzero().flatten()])
            spare.append(scored[(~informative).repeat_interleave(n).nonzero().flatten()])
            have = sum(len(b) for b in kept) // n
            if have >= wanted or draw >= dynamic.max_num_gen_batches:
                break
        pool = concat_sequences([b for b in kept + spare if len(b)], self.tokenizer.pad_token_id)
        batch = trim_padding(pool[: wanted * n], self.tokenizer.pad_token_id)
        reward_metrics["dynamic_sampling/gen_rounds"] = float(draw)
        reward_metrics["dynamic_sampling/informative_groups"] = float(have)
        return batch, {**metrics, **reward_metrics}

    def with_greedy_baselines(self, scored: Batch) -> Batch:
        """``reward_baselines [B]``: the score of each group's greedy response (ReMax), repeated over
        the group's ``n`` rows. The greedy responses come from the weights the engines hold: the
        trainer's latest (sync), or the replicas' (asynchronous modes), which differ from the
        sampled responses' by at most the staleness bound. A baseline only has to be independent
        of the response it is subtracted from, which both are."""
        n = self.config.rollout.n
        prompts = self.train_data.collate([int(i) for i in scored["index"][::n]])
        greedy = self.rollout.generate(prompts, [0] * len(prompts), self.config.rollout.sampling(0.0), None)
        baselines = self.score(greedy, training=False)[0]["token_level_scores"].sum(-1)
        return scored.assign(tensors={"reward_baselines": baselines.repeat_interleave(n)})

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
        prompts, seeds = validation_prompts(
            self.val_data, self.config.data.val_max_samples, rollout.val_n, self.config.trainer.seed
        )
        scored, _ = self.score(
            self.generate(prompts, seeds, rollout.val_temperature, validation=True), training=False
        )
        if self.config.agent.enabled:  # the validation episodes' tool calls are not the next step's
            self.rollout.agent_tool_totals()
        metrics = validation_metrics(scored, rollout.val_n)
        samples = validation_samples(scored, self.val_data, self.tokenizer, rollout.val_n)
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
            run_plan(self.config, params, self.train_data, val_prompts, self.total_steps, self.step)
        )


def _groups_with_spread(batch: Batch, n: int, metric: str) -> torch.Tensor:
    """``[G]`` bool: groups of ``n`` consecutive rows whose ``metric`` (``score``, ``raw_score`` or
    ``acc``) is not all equal."""
    values = batch["token_level_scores"].sum(-1) if metric == "score" else batch[metric]
    return values.view(-1, n).std(dim=1) > 0


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): tree}
