"""``TrainConfig``: everything ``tandem train`` reads, as typed dataclasses validated up front.

Batch-size semantics (the same as verl's):

* ``data.train_batch_size`` — prompts sampled per step; each gets ``rollout.n`` responses,
  so a step trains on ``train_batch_size * n`` sequences.
* ``actor.ppo_mini_batch_size`` — prompts per optimizer step (``* n`` sequences); a step
  makes ``train_batch_size / ppo_mini_batch_size`` optimizer steps per epoch, for
  ``actor.ppo_epochs`` epochs.
* micro-batches — how a mini-batch is cut for gradient accumulation: a token budget
  (``actor.engine.max_tokens_per_micro_batch``, with packing) or a sequence count
  (``actor.engine.micro_batch_size``). They change memory, never the result.
* workers — ``trainer.nnodes`` nodes of ``trainer.n_gpus_per_node`` GPU workers each (one
  per GPU), or of ``trainer.n_workers`` CPU workers each; every worker gets an equal share of
  every mini-batch, so ``ppo_mini_batch_size * n`` must divide by their number.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tandem.agents.config import AgentConfig
from tandem.config.paths import INPUT_PATH, MODEL_PATH, path_field
from tandem.controller.resource_pool import ResourcePool
from tandem.pipeline.config import PipelineConfig
from tandem.rl.config.actor import ActorConfig
from tandem.rl.config.algorithm import AlgorithmConfig
from tandem.rl.config.data import RLDataConfig
from tandem.rl.config.dataplane import RLDataPlaneConfig
from tandem.rl.config.reward import MODEL_SOURCE, RewardConfig
from tandem.rl.config.rollout import RolloutConfig
from tandem.rl.config.rules import check_train_config
from tandem.rl.config.teacher import TeacherConfig
from tandem.rl.config.trainer import TrainerConfig
from tandem.rl.critic_config import CriticConfig
from tandem.rl.stage_registry import needs_reference, old_log_probs_source, uses_critic


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``tandem train`` reads; ``model_path`` is the policy (and reference) HF directory;
    ``plugins``: user files imported before the rest validates (:mod:`tandem.config.plugins`)."""

    model_path: str = path_field(MODEL_PATH)
    data: RLDataConfig = field(default_factory=RLDataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    dataplane: RLDataPlaneConfig = field(default_factory=RLDataPlaneConfig)
    plugins: tuple[str, ...] = path_field(INPUT_PATH, ())

    def __post_init__(self) -> None:
        check_train_config(self)  # the sections validated their own fields; these rules join them

    @property
    def uses_critic(self) -> bool:
        """A critic is trained: the step plan's update says so (``StepStage.critic``)."""
        return uses_critic(self)

    @property
    def critic_mini_batch_prompts(self) -> int:
        return self.critic.ppo_mini_batch_size or self.mini_batch_prompts

    @property
    def critic_epochs(self) -> int:
        return self.critic.ppo_epochs or self.actor.ppo_epochs

    @property
    def critic_loss_agg_mode(self) -> str:
        return self.critic.loss_agg_mode or self.actor.policy_loss.loss_agg_mode

    @property
    def needs_reference(self) -> bool:
        """Reference log-probs are computed: the step plan's update reads them (``StepStage.reference``:
        for a KL term, or for a preference loss that has one)."""
        return needs_reference(self)

    @property
    def workers_per_node(self) -> int:
        return self.trainer.n_gpus_per_node or self.trainer.n_workers

    @property
    def world_size(self) -> int:
        """Data-parallel workers in all: ``nnodes * (n_gpus_per_node or n_workers)``."""
        return self.trainer.nnodes * self.workers_per_node

    @property
    def actor_dp_size(self) -> int:
        """The actor's data-parallel ranks: ``world_size / (actor.engine.sp_size * tp_size)`` (the
        workers of a sequence- or tensor-parallel group share their rows)."""
        return self.world_size // (self.actor.engine.sp_size * self.actor.engine.tp_size)

    @property
    def gpus_per_worker(self) -> float:
        """What every pool of the run reserves per process: one GPU on GPUs, none on CPU workers."""
        return 1.0 if self.trainer.n_gpus_per_node else 0.0

    def resource_pool(self) -> ResourcePool:
        """The workers' placement: ``workers_per_node`` on each of ``nnodes`` nodes, one GPU each on GPUs."""
        return ResourcePool(
            (self.workers_per_node,) * self.trainer.nnodes,
            gpus_per_process=self.gpus_per_worker,
            name="actor_rollout_ref",
        )

    def critic_resource_pool(self) -> ResourcePool:
        """The critic group's placement: the actor's shape, in a pool of its own (with Ray, GPUs of its
        own; the local backend binds critic rank ``r`` to actor rank ``r``'s device)."""
        return dataclasses.replace(self.resource_pool(), name="critic")

    def teacher_resource_pool(self) -> ResourcePool:
        """The teacher group's placement (``teacher.placement=separate``): the actor's shape, in a
        pool of its own."""
        return dataclasses.replace(self.resource_pool(), name="teacher")

    @property
    def distills(self) -> bool:
        """A teacher scores the sampled tokens (``algorithm.distill.objective``)."""
        return self.algorithm.distill.enabled

    def reward_model_resource_pool(self) -> ResourcePool:
        """The reward-model scorers' placement: ``reward.model.n_workers`` on the first node, one
        GPU each on GPUs."""
        return ResourcePool(
            (self.reward.model.n_workers,),
            gpus_per_process=self.gpus_per_worker,
            name="reward_model",
        )

    def rollout_resource_pool(self) -> ResourcePool:
        """The rollout replicas' placement (every pipeline mode but ``sync``): ``pipeline.rollout_replicas``
        processes, split evenly over ``pipeline.rollout_nodes`` nodes (one node-share each, on distinct
        nodes), each with the GPUs its engine computes on (one, or vLLM's tensor-parallel size)."""
        nodes = self.pipeline.rollout_nodes
        return ResourcePool(
            (self.pipeline.rollout_replicas // nodes,) * nodes,
            gpus_per_process=self.gpus_per_worker * self.rollout.engine.gpus_per_engine,
            name="rollout",
        )

    def resource_pools(self) -> list[ResourcePool]:
        """Every pool the run places: the actor's, and the critic's, the teacher's, the reward model's
        and the rollout replicas' when the run has them apart from the actor."""
        pools = [self.resource_pool()]
        if self.uses_critic and self.critic.placement != "colocated":
            pools.append(self.critic_resource_pool())
        if self.distills and self.teacher.placement != "colocated":
            pools.append(self.teacher_resource_pool())
        if MODEL_SOURCE in self.reward.sources:
            pools.append(self.reward_model_resource_pool())
        if self.pipeline.disaggregated:
            pools.append(self.rollout_resource_pool())
        return pools

    def schedule_steps(self, total_steps: int, epochs: int, mini_batch_prompts: int) -> int:
        """Learning-rate schedule steps over a run of ``total_steps`` RL steps (``trainer.lr_schedule_unit``)."""
        if self.trainer.lr_schedule_unit == "step":
            return total_steps
        return total_steps * epochs * (self.data.train_batch_size // mini_batch_prompts)

    @property
    def mini_batch_prompts(self) -> int:
        return self.actor.ppo_mini_batch_size or self.data.train_batch_size

    @property
    def old_log_probs_source(self) -> str:
        """Where PPO's old log-probs come from (``none``, ``rollout``, ``update`` or ``pass``): the
        step plan's update declares it (:func:`tandem.rl.stage_registry.old_log_probs_source`, the
        one place that asks; the policy-gradient update's choice is
        :func:`tandem.rl.stages.old_log_probs.policy_gradient_old_log_probs`)."""
        return old_log_probs_source(self)

    @property
    def old_log_probs_from_update(self) -> bool:
        """The update's forward gives the old log-probs (``old_log_probs_source == "update"``)."""
        return self.old_log_probs_source == "update"

    @property
    def old_log_probs_from_rollout(self) -> bool:
        """The rollout gives the old log-probs (``old_log_probs_source == "rollout"``)."""
        return self.old_log_probs_source == "rollout"

    @property
    def max_sequence_length(self) -> int:
        return self.data.max_prompt_length + self.rollout.max_response_length
