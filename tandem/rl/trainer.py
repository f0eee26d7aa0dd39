"""``RLTrainer``: the RL loop — it reads like the algorithm.

Each step: sample prompts -> generate ``n`` responses -> score them -> old (and reference)
log-probs -> advantages on the controller -> actor update in mini-batches -> sync the new
weights into the rollout engines -> log -> validate / checkpoint on schedule.

With ``pipeline.mode=sync`` the workers generate and train in turn (colocated). The
asynchronous modes take generation out of the step: rollout replicas produce prompt groups
while the trainer trains (:class:`tandem.pipeline.runner.AsyncRollout`), and the step takes
its batch from them and hands back each new weight version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from tandem.agents.loops import episode_metrics
from tandem.agents.trajectory import final_answer
from tandem.algos import (
    AdvantageInput,
    apply_kl_penalty,
    build_kl_controller,
    compute_advantage,
    compute_rollout_correction,
)
from tandem.config.paths import check_workers_share_output_dir, with_absolute_paths
from tandem.controller import Role, check_placement, create_colocated_group, create_worker_group
from tandem.engine.divergence import check_health, check_skipped_in_a_row
from tandem.models.loading import load_tokenizer
from tandem.pipeline.colocated import ColocatedRollout
from tandem.pipeline.runner import AsyncRollout
from tandem.protocol import Batch, group_ids_from_uids
from tandem.report import RunInfo
from tandem.report.tracker import ReportTracker
from tandem.rl.balance import balanced_rank_order
from tandem.rl.checkpoints import CheckpointManager
from tandem.rl.config import TrainConfig
from tandem.rl.critic_worker import CriticWorker
from tandem.rl.data import RLDataset
from tandem.rl.derived import derive_seed
from tandem.rl.metrics import data_metrics, timed, timing_metrics, value_metrics
from tandem.rl.preference_pairs import best_worst_pairs, with_reference_sums
from tandem.rl.rewards.model_worker import RewardModelWorker
from tandem.rl.rewards.sources import RewardSources
from tandem.rl.sequences import (
    concat_sequences,
    decode_responses,
    last_sampled_token,
    response_lengths,
    trim_padding,
)
from tandem.rl.trackers import build_trackers
from tandem.rl.worker import ActorRolloutRefWorker, reduce_metric
from tandem.rollout.factory import check_engine_installed
from tandem.run_dir import OutputDirLock, check_output_dir
from tandem.sft.sampler import EpochSampler


@dataclass
class RLResult:
    """Every logged step's metrics, the last validation metrics, and where the outputs went."""

    history: list[dict[str, float]]
    validation: dict[str, float]
    output_dir: Path
    hf_model_dir: Path | None
    report: Path | None


VALIDATION_SEED_TAG = 7_777_777  # derive_seed(run seed, this, row): validation sampling


PLACEMENT_KEYS = (  # what shapes the pools of config.resource_pools(), named when they cannot be placed
    "trainer.nnodes, trainer.n_gpus_per_node (or trainer.n_workers), critic.placement, reward.model.n_workers "
    "and pipeline.rollout_replicas"
)

# the config's paths, made absolute where the run starts (tandem.config.paths)
PATH_OUTPUTS = ("trainer.output_dir", "trainer.profile_dir", "pipeline.checkpoint_engine.directory")
PATH_INPUTS = (
    "model_path",
    "actor.engine.model_path",
    "critic.model_path",
    "critic.engine.model_path",
    "reward.model.path",
    "reward.custom_path",
    "data.train_path",
    "data.val_path",
    "agent.tools_path",
    "agent.interaction_path",
)


class RLTrainer:
    """Runs :class:`TrainConfig` end to end (see the module docstring)."""

    def __init__(self, config: TrainConfig, console: Console | None = None) -> None:
        config = with_absolute_paths(config, PATH_OUTPUTS, PATH_INPUTS)  # workers may run elsewhere (Ray)
        self.config = config
        self.console = console or Console()
        self.output_dir = check_output_dir(config.trainer.output_dir, "trainer.output_dir")
        data = config.data
        self.tokenizer = load_tokenizer(config.model_path)
        self.train_data = RLDataset.load(
            data.train_path, self.tokenizer, data.max_prompt_length, data.overlong_prompts
        )
        self.val_data = (
            RLDataset.load(data.val_path, self.tokenizer, data.max_prompt_length, data.overlong_prompts)
            if data.val_path
            else None
        )
        self.rewards = RewardSources(config.reward)
        self.rewards.check_sources([s.data_source for s in self.train_data.samples])
        if self.val_data is not None:
            self.rewards.check_sources([s.data_source for s in self.val_data.samples])
        steps_per_epoch = len(self.train_data) // data.train_batch_size
        if steps_per_epoch == 0 and not config.trainer.total_steps:
            raise ValueError(
                f"data.train_batch_size={data.train_batch_size} exceeds the {len(self.train_data)} training prompts; "
                "lower it or set trainer.total_steps"
            )
        self.total_steps = config.trainer.total_steps or steps_per_epoch * config.trainer.total_epochs
        self.sampler = EpochSampler(len(self.train_data), config.trainer.seed, data.shuffle)
        self.kl_controller = build_kl_controller(config.algorithm.kl)
        self.checkpoints = CheckpointManager(self.output_dir / "checkpoints", config.trainer.keep_last)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.validation: dict[str, float] = {}  # the last validation's metrics
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
        self.rollout: ColocatedRollout | AsyncRollout | None = None  # built with the workers
        self.critics = None  # the critic's worker group, when the estimator reads values

    # ------------------------------------------------------------------ the loop
    def fit(self) -> RLResult:
        """Train for ``total_steps`` steps; returns the metrics history and output locations.

        The run holds ``trainer.output_dir`` for its duration: a second run there is refused.
        """
        with OutputDirLock(self.output_dir, "trainer.output_dir"):
            return self._fit()

    def _fit(self) -> RLResult:
        config, trainer = self.config, self.config.trainer
        pool = config.resource_pool()
        check_placement(
            config.resource_pools(),
            trainer.backend,
            PLACEMENT_KEYS,
            device=("trainer.device", trainer.device),
        )
        if trainer.backend != "ray":  # Ray's nodes may have packages the controller's host lacks
            check_engine_installed(config.rollout.engine.name)
        with contextlib.ExitStack() as groups:
            colocated = config.uses_critic and config.critic.placement == "colocated"
            if colocated:  # the critic in the actor's processes: group.actor.<m>, group.critic.<m>
                roles = {
                    "actor": Role(ActorRolloutRefWorker, (config,)),
                    "critic": Role(CriticWorker, (config,)),
                }
                fused = groups.enter_context(create_colocated_group(roles, pool, trainer.backend))
                workers, self.critics = fused.actor, fused.critic
            else:
                workers = groups.enter_context(
                    create_worker_group(ActorRolloutRefWorker, pool, trainer.backend, args=(config,))
                )
                self.critics = None
            self.workers = workers
            check_workers_share_output_dir(workers, self.output_dir)
            params = workers.init_model(
                config.schedule_steps(self.total_steps, config.actor.ppo_epochs, config.mini_batch_prompts)
            )[0]
            if config.uses_critic and not colocated:  # a group of its own, with the actor's worker count
                self.critics = groups.enter_context(
                    create_worker_group(
                        CriticWorker, config.critic_resource_pool(), trainer.backend, args=(config,)
                    )
                )
                check_workers_share_output_dir(self.critics, self.output_dir)  # its checkpoints go there too
            if self.critics is not None:
                critic_steps = config.schedule_steps(
                    self.total_steps, config.critic_epochs, config.critic_mini_batch_prompts
                )
                params_critic = self.critics.init_model(critic_steps)[0]
                self.console.print(
                    f"critic: {params_critic / 1e6:.2f}M parameters, {config.world_size} worker(s), "
                    f"{config.critic.placement}"
                )
            if "model" in config.reward.sources:  # a pool of its own
                model = config.reward.model
                scorers = groups.enter_context(
                    create_worker_group(
                        RewardModelWorker, config.reward_model_resource_pool(), trainer.backend,
                        args=(model, trainer.device),
                    )
                )  # fmt: skip
                params_rm = scorers.init_model()[0]
                self.rewards.model_group = scorers
                self.console.print(
                    f"reward model: {params_rm / 1e6:.2f}M parameters from {model.path}, {model.n_workers} worker(s)"
                )
            resumed = self._resume()
            self._print_plan(params)
            trackers = build_trackers(
                trainer.loggers, self.output_dir, self.total_steps, self.step, resumed,
                trainer.project, trainer.experiment, _flatten(dataclasses.asdict(config)), self.console,
            )  # fmt: skip
            report = None
            if trainer.report and "jsonl" in trainer.loggers:
                report = ReportTracker(self.output_dir, trainer.report_every)
                trackers.append(report)  # after the JSONL tracker, whose file it draws
            failed = True  # until the loop ends normally: the pipeline then closes without ceremony
            try:
                with self.run_info.running(self.step):  # status.json: running, then finished or failed
                    self.rollout = (
                        AsyncRollout(config, workers, self.train_data, self.sampler, self.tokenizer)
                        if config.pipeline.disaggregated
                        else ColocatedRollout(workers, self.tokenizer.pad_token_id)
                    )
                    self.rollout.start(self.step)
                    self._train_loop(trackers)
                failed = False
            finally:
                if self.rollout is not None:
                    self.rollout.close(failed)
                for tracker in trackers:
                    tracker.close()
            hf_dir = None
            if trainer.export_hf:
                hf_dir = self.output_dir / "hf_model"
                workers.export_hf(str(hf_dir))
            workers.shutdown_engines()
        if report is not None:
            self.console.print(f"report: {report.path}")
        return RLResult(self.history, self.validation, self.output_dir, hf_dir, report and report.path)

    def _train_loop(self, trackers: list) -> None:
        """Validate first (unless resumed), then step, validate and checkpoint on schedule."""
        trainer = self.config.trainer
        if self.val_data is not None and trainer.val_before_train and self.step == 0:
            self.validation = self.validate()
            self._log(trackers, self.validation)
        while self.step < self.total_steps:
            with self._profiled(self.step + 1):
                metrics = self.train_step()
            last = self.step == self.total_steps
            if self.val_data is not None and (
                (trainer.val_every and self.step % trainer.val_every == 0) or last
            ):
                self.validation = self.validate()
                metrics.update(self.validation)
            self._log(trackers, metrics)
            if (trainer.save_every and self.step % trainer.save_every == 0) or last:
                self.save_checkpoint()

    def train_step(self) -> dict[str, float]:
        """One RL step; returns its metrics."""
        self.step += 1
        timings: dict[str, float] = {}
        with timed(timings, "step"):
            if isinstance(self.rollout, AsyncRollout):  # the batch streams in from the replicas
                with timed(timings, "gen"):  # the trainer's wait for finished prompt groups
                    generated, metrics = self.rollout.next_batch(self.step)
                with timed(timings, "reward"):
                    batch, reward_metrics = self.score(generated)
                metrics.update(reward_metrics)
            else:
                batch, metrics = self.rollout_batch(timings)
            update = self._preference_update if self.config.prefers else self._policy_gradient_update
            batch, update_metrics = update(batch, timings)
            metrics.update(update_metrics)
            metrics["actor/max_abs_weight"] = self.check_divergence(metrics)
            with timed(timings, "update_weights"):
                metrics.update(self.rollout.after_update(self.step))
        memory = self.workers.memory_metrics()  # per phase on GPUs (the largest rank); empty on the CPU
        metrics.update({name: max(m[name] for m in memory) for name in memory[0]})
        metrics.update(data_metrics(batch, self.config.rollout.max_response_length))
        if "agent_turns" in batch:
            metrics.update(
                episode_metrics(
                    batch["agent_turns"], batch["agent_tool_calls"], batch["agent_tool_errors"],
                    batch["finish_reason"], self.rollout.agent_tool_totals(),
                )
            )  # fmt: skip
        metrics.update(timing_metrics(timings, int(batch["attention_mask"].sum()), self.config.world_size))
        metrics["training/epoch"] = float(self.sampler.epoch)
        return metrics

    def _policy_gradient_update(
        self, batch: Batch, timings: dict[str, float]
    ) -> tuple[Batch, dict[str, float]]:
        """Old and reference log-probs, advantages, then the actor's PPO-style update."""
        if self.config.trainer.balance_batch and self.config.world_size > 1:
            order = balanced_rank_order(
                batch["attention_mask"], self.config.rollout.n, self.config.world_size
            )
            batch = batch.reorder(order)
        if self.config.old_log_probs_from_rollout:
            batch = batch.assign(tensors={"old_log_probs": batch["rollout_log_probs"]})
        elif not self.config.old_log_probs_from_update:
            with timed(timings, "old_log_prob"):
                batch = batch.union(self.workers.compute_log_prob(batch))
        if self.config.needs_reference:
            with timed(timings, "ref"):
                batch = batch.union(self.workers.compute_ref_log_prob(batch))
        if self.critics is not None:
            with timed(timings, "values"):
                batch = batch.union(self.critics.compute_values(batch))
        with timed(timings, "adv"):
            batch, adv_metrics = self.compute_advantages(batch)
        metrics: dict[str, float] = {}
        if self.critics is not None:
            with timed(timings, "update_critic"):
                per_worker = self.critics.update_critic(batch)
            metrics.update(
                {name: reduce_metric(name, [m[name] for m in per_worker]) for name in per_worker[0]}
            )
            metrics.update(value_metrics(batch))
        if self.step > self.config.critic.warmup_steps or self.critics is None:
            with timed(timings, "update_actor"):
                metrics.update(self._update_actor(batch))
        return batch, {**metrics, **adv_metrics}  # the controller's measures win over the workers' ones

    def _preference_update(self, batch: Batch, timings: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        """Online DPO: each prompt's best and worst response form a pair; reference log-probs of
        the pairs; one preference-loss step. Returns the whole scored batch (for its statistics)."""
        batch = batch.assign(
            tensors={"token_level_rewards": batch["token_level_scores"]}
        )  # no KL in the reward
        with timed(timings, "adv"):
            pairs, metrics = best_worst_pairs(batch, self.config.rollout.n, self.config.world_size)
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
        per_worker = self.workers.update_actor(batch, step=self.step)
        return {name: reduce_metric(name, [m[name] for m in per_worker]) for name in per_worker[0]}

    # ------------------------------------------------------------------ stages
    def rollout_batch(self, timings: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        """Generate and score ``train_batch_size`` prompt groups (DAPO dynamic sampling when enabled)."""
        config = self.config
        wanted, n = config.data.train_batch_size, config.rollout.n
        dynamic = config.algorithm.filter_groups
        kept: list[Batch] = []
        spare: list[Batch] = []
        reward_metrics: dict[str, float] = {}
        rounds = 0
        while True:
            rounds += 1
            prompts = self.train_data.collate(self.sampler.take(wanted))
            prompts = prompts.assign(
                non_tensors={"uid": [f"{self.step}-{rounds}-{i}" for i in range(len(prompts))]}
            )
            baselines = None
            if config.algorithm.needs_greedy_baseline:
                with timed(timings, "gen_greedy"):
                    greedy = self.generate(prompts, [0] * len(prompts), temperature=0.0)
                    baselines = self.score(greedy, training=False)[0]["token_level_scores"].sum(-1)
                    baselines = baselines.repeat_interleave(n)
            samples = prompts.repeat(n, interleave=True)
            seeds = [derive_seed(config.trainer.seed, self.step, rounds, i) for i in range(len(samples))]
            with timed(timings, "gen"):
                generated = self.generate(samples, seeds, config.rollout.temperature)
            with timed(timings, "reward"):
                scored, reward_metrics = self.score(generated)
            if baselines is not None:
                scored = scored.assign(tensors={"reward_baselines": baselines})
            if not dynamic.enable:
                return scored, reward_metrics
            informative = _groups_with_spread(scored, n, self.config.algorithm.filter_groups.metric)
            kept.append(scored[informative.repeat_interleave(n).nonzero().flatten()])
            spare.append(scored[(~informative).repeat_interleave(n).nonzero().flatten()])
            have = sum(len(b) for b in kept) // n
            if have >= wanted or rounds >= dynamic.max_num_gen_batches:
                break
        # Short of informative groups after the last round: top up with uninformative ones (they add no gradient).
        pool = concat_sequences([b for b in kept + spare if len(b)], self.tokenizer.pad_token_id)
        batch = trim_padding(pool[: wanted * n], self.tokenizer.pad_token_id)
        reward_metrics["dynamic_sampling/gen_rounds"] = float(rounds)
        reward_metrics["dynamic_sampling/informative_groups"] = float(have)
        return batch, reward_metrics

    def generate(
        self, prompts: Batch, seeds: list[int], temperature: float, validation: bool = False
    ) -> Batch:
        """Responses for each row of ``prompts`` (one request per row), trimmed to the longest;
        ``validation`` samples with the validation top-p/top-k."""
        sampling = self.config.rollout.sampling(temperature, validation=validation)
        return self.rollout.generate(prompts, seeds, sampling, self.step)

    def score(self, batch: Batch, training: bool = True) -> tuple[Batch, dict[str, float]]:
        """``token_level_scores`` (the score on each response's last sampled token) and ``acc [B]``;
        in training also ``reward_components [B, K]`` when the advantage estimator reads them.

        An agent episode is scored on its final answer (the last model turn's text); its whole
        conversation is in the scorer's ``extra_info["messages"]``, and the reward an interaction
        ended it with (or None) in ``extra_info["interaction_reward"]``."""
        mask = batch["response_mask"]
        lengths = response_lengths(batch)
        if "agent_messages" in batch:
            texts = [final_answer(messages) for messages in batch["agent_messages"]]
            batch = batch.assign(
                non_tensors={
                    "extra_info": [
                        {**info, "messages": messages, "interaction_reward": reward}
                        for info, messages, reward in zip(
                            batch["extra_info"], batch["agent_messages"], batch["agent_reward"], strict=True
                        )
                    ]
                }
            )
        else:
            texts = decode_responses(self.tokenizer, batch["responses"], lengths)
        keys = self.config.algorithm.reward_component_keys if training else ()
        result = self.rewards.score(batch, texts, lengths, self.config.rollout.max_response_length, keys)
        token_scores = torch.zeros(mask.shape, dtype=torch.float32)
        token_scores[torch.arange(len(batch)), last_sampled_token(mask)] = result.scores
        if result.errors:
            self.console.print(f"[yellow]reward: {len(result.errors)} failed ({result.errors[0]}); scored 0")
        if result.notes:
            self.console.print(f"[yellow]reward: {len(result.notes)} fields left out ({result.notes[0]})")
        tensors = {"token_level_scores": token_scores, "acc": result.accuracy, "raw_score": result.raw_scores}
        if result.components is not None:
            tensors["reward_components"] = result.components
        return batch.assign(tensors=tensors), result.metrics

    def compute_advantages(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """KL penalty (if any), rollout correction, and the configured advantage estimator."""
        algorithm = self.config.algorithm
        metrics: dict[str, float] = {}
        mask = batch["response_mask"]
        rewards = batch["token_level_scores"]
        if algorithm.kl.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty(
                rewards, batch["old_log_probs"], batch["ref_log_probs"], mask,
                self.kl_controller.value, algorithm.kl.estimator,
            )  # fmt: skip
            self.kl_controller.update(float(kl_metrics["kl"]), len(batch))
            metrics.update({f"actor/reward_{k}": float(v) for k, v in kl_metrics.items()})
        weights = None
        if "old_log_probs" in batch:  # else the update measures the mismatch (on-policy, no correction)
            correction = compute_rollout_correction(
                batch["old_log_probs"], batch["rollout_log_probs"], mask, algorithm.rollout_correction
            )
            metrics.update({k: float(v) for k, v in correction.metrics.items()})
            mask, weights = correction.response_mask, correction.is_weights
        advantage = compute_advantage(
            AdvantageInput(
                rewards,
                mask,
                group_ids_from_uids(batch["uid"]),
                reward_baselines=batch.get("reward_baselines"),
                reward_components=batch.get("reward_components"),
                old_log_probs=batch.get("old_log_probs"),
                sum_pi_squared=batch.get("sum_pi_squared"),
                rollout_is_weights=weights,
                values=batch.get("values"),
            ),
            algorithm.advantage_config(),
        )
        tensors = {"token_level_rewards": rewards, "advantages": advantage.advantages, "response_mask": mask}
        if "values" in batch:  # the critic's targets
            tensors["returns"] = advantage.returns
        if weights is not None:
            tensors["rollout_is_weights"] = weights
        return batch.assign(tensors=tensors), metrics

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
        """Accuracy on the validation prompts per data source: ``val-core/<source>/acc/mean@<n>``."""
        assert self.val_data is not None
        rollout = self.config.rollout
        count = len(self.val_data)
        if self.config.data.val_max_samples:
            count = min(count, self.config.data.val_max_samples)
        prompts = self.val_data.collate(list(range(count))).repeat(rollout.val_n, interleave=True)
        seeds = [derive_seed(self.config.trainer.seed, VALIDATION_SEED_TAG, i) for i in range(len(prompts))]
        scored, _ = self.score(
            self.generate(prompts, seeds, rollout.val_temperature, validation=True), training=False
        )
        if self.config.agent.enabled:  # the validation episodes' tool calls are not the next step's
            self.rollout.agent_tool_totals()
        metrics: dict[str, float] = {}
        sources = scored["data_source"]
        for source in sorted(set(sources)):
            rows = torch.tensor([s == source for s in sources])
            metrics[f"val-core/{source}/acc/mean@{rollout.val_n}"] = float(scored["acc"][rows].mean())
            metrics[f"val-aux/{source}/score/mean@{rollout.val_n}"] = float(
                scored["token_level_scores"][rows].sum(-1).mean()
            )
        metrics["val-aux/response_length/mean"] = float(response_lengths(scored).float().mean())
        return metrics

    # ------------------------------------------------------------------ checkpoints and logging
    def save_checkpoint(self) -> Path:
        state = {
            "step": self.step,
            "sampler": self.sampler.state(),
            "kl_coef": self.kl_controller.value,
            "python_random": repr(random.getstate()),
        }
        path = self.checkpoints.save(self.step, state, self._save_engines)
        self.console.print(f"checkpoint: {path}")
        return path

    def _save_engines(self, directory: Path) -> None:
        self.workers.save_checkpoint(str(directory / "actor"))
        if self.critics is not None:
            self.critics.save_checkpoint(str(directory / "critic"))

    def _resume(self) -> bool:
        mode = self.config.trainer.resume
        if mode == "disable":
            return False
        path = (
            self.checkpoints.latest() if mode == "auto" else Path(mode).absolute()
        )  # workers may run elsewhere
        if path is None:
            return False
        state = CheckpointManager.read_state(path)
        self.workers.load_checkpoint(str(path / "actor"), state["step"])
        if self.critics is not None:
            if not (path / "critic").exists():
                raise ValueError(f"{path} holds no critic state; it was saved by a run without a critic")
            self.critics.load_checkpoint(str(path / "critic"))
        self.step = state["step"]
        self.sampler.load_state(state["sampler"])
        self.kl_controller.value = state["kl_coef"]
        self.console.print(f"resumed from {path} (step {self.step})")
        return True

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

    def _log(self, trackers: list, metrics: dict[str, float]) -> None:
        bad = sorted(k for k, v in metrics.items() if not math.isfinite(v))
        if bad:
            self.console.print(f"[red]step {self.step}: non-finite metrics {bad}")
        self.history.append({"step": self.step, **metrics})
        for tracker in trackers:
            tracker.log(metrics, self.step)
        self.run_info.progress(self.step)

    def _print_plan(self, params: int) -> None:
        config = self.config
        data, n = config.data, config.rollout.n
        dropped = self.train_data.filtered
        self.console.print(
            f"[bold]RL[/] {config.algorithm.adv_estimator} + {config.actor.policy_loss.name} loss, "
            f"policy {params / 1e6:.2f}M parameters, {config.world_size} worker(s) on {config.trainer.backend} "
            f"(device {config.trainer.device}), {config.rollout.engine.name} rollout engine"
            f"{_pipeline_plan(config)}\n"
            f"  {len(self.train_data)} training prompts ({dropped} over {data.max_prompt_length} tokens filtered), "
            f"{len(self.val_data) if self.val_data else 0} validation prompts\n"
            f"  {self.total_steps} steps of {data.train_batch_size} prompts x {n} responses; "
            f"{data.train_batch_size // config.mini_batch_prompts} optimizer step(s) x {config.actor.ppo_epochs} epoch(s) "
            f"per step; starting at step {self.step}"
        )


def _pipeline_plan(config: TrainConfig) -> str:
    pipeline = config.pipeline
    if not pipeline.disaggregated:
        return ", colocated (pipeline.mode=sync)"
    plan = f", {pipeline.rollout_replicas} rollout replica(s), pipeline.mode={pipeline.mode}"
    if pipeline.mode == "fully_async":
        plan += (
            f" (staleness_threshold {pipeline.staleness_threshold}, partial_rollout "
            f"{pipeline.partial_rollout}, sync every {pipeline.trigger_parameter_sync_step} step(s))"
        )
    return plan + f", weights by {pipeline.checkpoint_engine.backend}"


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
