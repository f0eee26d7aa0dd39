"""The rules of ``tandem train``'s config that join sections: each one a function of the whole
:class:`~tandem.rl.config.train.TrainConfig`, raising ``ValueError`` that names the keys involved.

:func:`check_train_config` runs them all, in a fixed order (the first broken rule is the one
reported): what is required, the parallel layout, the batch shapes, the head's precision
against the rollout's, the KL loss, the agent's rewards, the asynchronous pipelines, the step
plan's stages' own rules (online DPO's, DAPO's group filter, GKD's dataset steps: each in its stage
module, :mod:`tandem.rl.stages`), router replay, the critic, the teacher, then two kept beside what
they check: the data plane's
(:func:`tandem.run.dataplane.check_dataplane`, which SFT and DPO run too) and the derived engine
settings' (:func:`tandem.rl.derived.check_derived_fields`, beside the derivation it checks). A
section's own fields validate in its own ``__post_init__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.engine.config import check_trainer_parallel_dims
from tandem.engine.parallel_dims import ParallelDims
from tandem.rl.config.reward import INTERACTION_SOURCE
from tandem.rl.derived import check_derived_fields
from tandem.rl.stage_registry import build_step_plan
from tandem.run.dataplane import check_dataplane

if TYPE_CHECKING:
    from tandem.rl.config.train import TrainConfig


def check_train_config(config: TrainConfig) -> None:
    """Every cross-section rule of ``config``, in order; the first broken one raises."""
    check_required_inputs(config)
    check_parallel_layout(config)
    check_group_sizes(config)
    check_batch_shapes(config)
    check_head_precision(config)
    check_kl_loss(config)
    check_agent_rewards(config)
    check_pipeline(config)
    check_step_stages(config)
    check_router_replay(config)
    check_critic(config)
    check_teacher(config)
    check_dataplane(config.dataplane, config.trainer.backend, config.trainer.nnodes)
    check_derived_fields(config)


def check_required_inputs(config: TrainConfig) -> None:
    """The policy's ``model_path`` and the prompts' ``data.train_path`` are set."""
    if not config.model_path:
        raise ValueError("model_path is required (a local HF model directory)")
    if not config.data.train_path:
        raise ValueError("data.train_path is required (a parquet file of prompts in verl's schema)")


def check_parallel_layout(config: TrainConfig) -> None:
    """The actor's sequence-, tensor- and expert-parallel degrees divide the run's workers."""
    workers, sp = config.world_size, config.actor.engine.sp_size
    if workers % sp:
        raise ValueError(
            f"actor.engine.sp_size={sp} must divide the {workers} workers (trainer.nnodes x "
            "trainer.n_gpus_per_node or trainer.n_workers): each data-parallel rank is sp_size workers"
        )
    check_trainer_parallel_dims("actor.engine", config.actor.engine, workers)


def check_group_sizes(config: TrainConfig) -> None:
    """An estimator that compares a prompt's responses gets ``rollout.n >= 2`` (DAPO's group filter
    asks it in its stage's rule)."""
    n, algorithm = config.rollout.n, config.algorithm
    if algorithm.compares_groups and n < 2:
        raise ValueError(
            f"algorithm.adv_estimator={algorithm.adv_estimator!r} compares the responses of a prompt, "
            f"so rollout.n must be at least 2 (got {n})"
        )


def check_batch_shapes(config: TrainConfig) -> None:
    """Mini-batches divide the step's batch and spread evenly over the data-parallel ranks, and a
    packed micro-batch's token budget holds the longest sequence."""
    n, workers, mini = config.rollout.n, config.world_size, config.mini_batch_prompts
    if config.data.train_batch_size % mini:
        raise ValueError(
            f"actor.ppo_mini_batch_size={mini} must divide data.train_batch_size={config.data.train_batch_size}"
        )
    engine = config.actor.engine
    if (mini * n) % config.actor_dp_size:
        shared = workers // config.actor_dp_size  # workers per data-parallel rank (sp or tp)
        ranks = f"{workers} workers" if shared == 1 else f"{config.actor_dp_size} data-parallel ranks"
        over = "" if shared == 1 else f", over actor.engine.{'sp_size' if engine.sp_size > 1 else 'tp_size'}"
        raise ValueError(
            f"a mini-batch of actor.ppo_mini_batch_size * rollout.n = {mini * n} sequences must divide "
            f"evenly over the {ranks} (trainer.nnodes x trainer.n_gpus_per_node or trainer.n_workers{over})"
        )
    longest = config.max_sequence_length
    if engine.use_packing and engine.max_tokens_per_micro_batch < longest:
        raise ValueError(
            f"actor.engine.max_tokens_per_micro_batch={engine.max_tokens_per_micro_batch} is below the longest "
            f"sequence, data.max_prompt_length + rollout.max_response_length = {longest}"
        )


def check_head_precision(config: TrainConfig) -> None:
    """A bf16 log-prob head needs a bf16 rollout model, or the two sides' log-probs would differ."""
    rollout = config.rollout.engine
    if config.actor.engine.logprob_head_dtype == "bfloat16" and rollout.selected.dtype != "bfloat16":
        raise ValueError(
            f"actor.engine.logprob_head_dtype=bfloat16 rounds the head's inputs to bf16, but the rollout's "
            f"log-probs come from a {rollout.selected.dtype} model (rollout.engine.{rollout.name}.dtype): they "
            f"would disagree by that rounding; set rollout.engine.{rollout.name}.dtype=bfloat16 or keep the "
            "float32 head"
        )


def check_kl_loss(config: TrainConfig) -> None:
    """A KL loss that is on has a nonzero coefficient."""
    if config.algorithm.kl.use_kl_loss and config.algorithm.kl.kl_loss_coef == 0:
        raise ValueError("algorithm.kl.use_kl_loss is on but algorithm.kl.kl_loss_coef is 0")


def check_agent_rewards(config: TrainConfig) -> None:
    """The interaction reward source has an agent that ends episodes with a reward."""
    agent = config.agent
    if INTERACTION_SOURCE in config.reward.sources and not (agent.interaction_path or agent.uses_program):
        raise ValueError(
            f"reward.sources has {INTERACTION_SOURCE!r}: set agent.interaction_path (the user function whose "
            "reward ends an episode) and agent.name=interaction, or agent.program and agent.name=program"
        )


def check_pipeline(config: TrainConfig) -> None:
    """Settings that cannot work with rollout replicas apart from the trainer (or, in sync mode,
    without them), named by key."""
    pipeline = config.pipeline
    if not pipeline.disaggregated:
        tp = config.rollout.engine.gpus_per_engine
        if tp > 1:
            raise ValueError(
                f"rollout.engine.vllm.tensor_parallel_size={tp} needs replicas of their own: pipeline.mode=sync "
                "runs each engine in a trainer worker, on that worker's one GPU; use pipeline.mode=one_step_off "
                "or fully_async"
            )
        return
    mode = f"pipeline.mode={pipeline.mode}"
    if pipeline.rollout_nodes > 1 and config.trainer.backend != "ray":
        raise ValueError(
            f"pipeline.rollout_nodes={pipeline.rollout_nodes} puts replicas on several nodes, which needs "
            f"trainer.backend=ray (got trainer.backend={config.trainer.backend}: one machine)"
        )
    if config.rollout.free_cache_between_generations:
        raise ValueError(f"{mode} generates continuously; rollout.free_cache_between_generations must be off")
    offload = config.actor.offload
    if offload.params or offload.optimizer:
        key = "actor.offload.params" if offload.params else "actor.offload.optimizer"
        raise ValueError(
            f"{mode} generates on replicas of its own, so the trainer never waits on a generation; "
            f"{key} frees memory for a colocated rollout and must be off (actor.offload.reference may stay on)"
        )
    if pipeline.old_log_probs == "rollout" and config.algorithm.needs_sum_pi_squared:
        raise ValueError(
            f"algorithm.adv_estimator={config.algorithm.adv_estimator} needs sum_pi_squared from a trainer forward, "
            "which pipeline.old_log_probs=rollout skips; use pipeline.old_log_probs=recompute"
        )
    if pipeline.old_log_probs == "rollout" and (config.rollout.top_p < 1.0 or config.rollout.top_k):
        raise ValueError(
            f"pipeline.old_log_probs=rollout needs untruncated sampling (rollout.top_p=1, rollout.top_k=0; got "
            f"{config.rollout.top_p}, {config.rollout.top_k}): truncation changes the rollout's log-probs"
        )
    lag = pipeline.trigger_parameter_sync_step - 1
    if pipeline.mode == "fully_async" and pipeline.staleness_threshold < lag:
        raise ValueError(
            f"pipeline.staleness_threshold={pipeline.staleness_threshold} is below pipeline."
            f"trigger_parameter_sync_step - 1 = {lag}: between syncs the trainer would wait for samples "
            "that the threshold forbids the rollout to start"
        )


ROUTING_RECORDERS = ("native", "hf", "vllm")  # the rollout engines that return each token's experts


def check_router_replay(config: TrainConfig) -> None:
    """Rollout routing replay needs a rollout engine that records the experts, and single-turn
    episodes; errors name the keys."""
    if config.actor.router_replay == "off":
        return
    engine = config.rollout.engine.name
    if engine not in ROUTING_RECORDERS:
        raise ValueError(
            f"actor.router_replay={config.actor.router_replay} replays the experts the rollout recorded, and "
            f"rollout.engine.name={engine} does not return them yet: use one of {list(ROUTING_RECORDERS)} "
            "or actor.router_replay=off"
        )
    if config.agent.enabled:
        raise ValueError(
            f"actor.router_replay={config.actor.router_replay}: agent episodes (agent.name) do not carry "
            "the rollout's experts through their tool turns yet; set actor.router_replay=off"
        )


def check_step_stages(config: TrainConfig) -> None:
    """The rules of the stages the run's step plan holds (``StepStage.rule``: online DPO's, DAPO's
    group filter, GKD's dataset steps), in the plan's order; two stages claiming one slot raise."""
    build_step_plan(config).check(config)


def check_critic(config: TrainConfig) -> None:
    """The critic's batch sizes divide like the actor's, named by key."""
    if not config.uses_critic:
        return
    mini = config.critic_mini_batch_prompts
    if config.data.train_batch_size % mini:
        raise ValueError(
            f"critic.ppo_mini_batch_size={mini} must divide data.train_batch_size={config.data.train_batch_size}"
        )
    engine = config.critic.engine
    sp = engine.sp_size
    if config.world_size % sp:
        raise ValueError(f"critic.engine.sp_size={sp} must divide the {config.world_size} workers")
    check_trainer_parallel_dims("critic.engine", engine, config.world_size)
    ranks = config.world_size // (sp * engine.tp_size)  # sequence- and tensor-parallel peers share rows
    if (mini * config.rollout.n) % ranks:
        raise ValueError(
            f"a critic mini-batch of critic.ppo_mini_batch_size * rollout.n = {mini * config.rollout.n} sequences "
            f"must divide evenly over the {ranks} "
            + ("workers" if ranks == config.world_size else "data-parallel ranks")
        )


def check_teacher(config: TrainConfig) -> None:
    """A distillation objective has a teacher and a teacher has an objective (online DPO takes
    neither: its stage's rule says so); the teacher's sequence-, tensor- and expert-parallel sizes
    divide the workers, and with top-k tokens neither the teacher nor the student runs tensor-parallel yet.
    Errors name the keys."""
    distill, teacher = config.algorithm.distill, config.teacher
    if distill.enabled and not teacher.model_path:
        raise ValueError(
            f"algorithm.distill.objective={distill.objective!r} needs a teacher: set teacher.model_path"
        )
    if teacher.model_path and not distill.enabled:
        raise ValueError(
            "teacher.model_path is set but algorithm.distill.objective=none: choose an objective "
            "(reverse_kl) or leave teacher.model_path unset"
        )
    if distill.adds_loss and not teacher.top_k:
        raise ValueError(
            f"algorithm.distill.objective={distill.objective!r} compares distributions over the teacher's top-k "
            "tokens: set teacher.top_k (e.g. 16)"
        )
    engine, workers = teacher.engine, config.world_size
    if distill.enabled:  # frozen: any strategy scores a tensor-parallel group's rows, one group or several
        ParallelDims(workers, engine.sp_size, engine.tp_size, engine.ep_size).check(
            "teacher.engine", world=f"the {workers} workers", unit="workers"
        )
    if distill.enabled and teacher.top_k and engine.tp_size > 1:
        raise ValueError(
            f"teacher.top_k={teacher.top_k} with teacher.engine.tp_size={engine.tp_size}: the teacher's top-k "
            "tokens are not computed over a head split between tensor-parallel ranks yet; set teacher.top_k=0 "
            "(the reverse_kl objective) or teacher.engine.tp_size=1"
        )
    if distill.enabled and teacher.top_k and config.actor.engine.tp_size > 1:
        raise ValueError(
            f"teacher.top_k={teacher.top_k} with actor.engine.tp_size={config.actor.engine.tp_size}: the student's "
            "log-probs of the teacher's top-k tokens are not computed under tensor parallelism yet; set "
            "teacher.top_k=0 or actor.engine.tp_size=1"
        )
