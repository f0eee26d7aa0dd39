"""The rules of ``tandem train``'s config that join sections: each one a function of the whole
:class:`~tandem.rl.config.train.TrainConfig`, raising ``ValueError`` that names the keys involved.

:func:`check_train_config` runs them all, in a fixed order (the first broken rule is the one
reported): what is required, the parallel layout, the batch shapes, the head's precision
against the rollout's, the KL loss, the agent's rewards, then the rules that live beside the
section they mostly concern (pipeline, online DPO, router replay, critic, teacher, data plane,
derived engine settings). A section's own fields validate in its own ``__post_init__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.engine.config import check_trainer_tensor_parallel
from tandem.rl.config.actor import check_preference, check_router_replay
from tandem.rl.config.dataplane import check_dataplane
from tandem.rl.config.pipeline import check_pipeline
from tandem.rl.config.reward import INTERACTION_SOURCE
from tandem.rl.config.teacher import check_teacher
from tandem.rl.critic_config import check_critic
from tandem.rl.derived import check_derived_fields

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
    check_preference(config)
    check_router_replay(config)
    check_critic(config)
    check_teacher(config)
    check_dataplane(config.dataplane, config.trainer.backend)
    check_derived_fields(config)


def check_required_inputs(config: TrainConfig) -> None:
    """The policy's ``model_path`` and the prompts' ``data.train_path`` are set."""
    if not config.model_path:
        raise ValueError("model_path is required (a local HF model directory)")
    if not config.data.train_path:
        raise ValueError("data.train_path is required (a parquet file of prompts in verl's schema)")


def check_parallel_layout(config: TrainConfig) -> None:
    """The actor's sequence- and tensor-parallel degrees divide the run's workers."""
    workers, sp = config.world_size, config.actor.engine.sp_size
    if workers % sp:
        raise ValueError(
            f"actor.engine.sp_size={sp} must divide the {workers} workers (trainer.nnodes x "
            "trainer.n_gpus_per_node or trainer.n_workers): each data-parallel rank is sp_size workers"
        )
    check_trainer_tensor_parallel("actor.engine", config.actor.engine, workers)


def check_group_sizes(config: TrainConfig) -> None:
    """An estimator that compares a prompt's responses, and DAPO's group filter, get ``rollout.n >= 2``."""
    n, algorithm = config.rollout.n, config.algorithm
    if algorithm.compares_groups and n < 2:
        raise ValueError(
            f"algorithm.adv_estimator={algorithm.adv_estimator!r} compares the responses of a prompt, "
            f"so rollout.n must be at least 2 (got {n})"
        )
    if algorithm.filter_groups.enable and n < 2:
        raise ValueError("algorithm.filter_groups.enable needs rollout.n >= 2")


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
    """The interaction reward source has an agent that ends episodes with a reward, and a program
    agent runs in the synchronous pipeline."""
    agent = config.agent
    if INTERACTION_SOURCE in config.reward.sources and not (agent.interaction_path or agent.uses_program):
        raise ValueError(
            f"reward.sources has {INTERACTION_SOURCE!r}: set agent.interaction_path (the user function whose "
            "reward ends an episode) and agent.name=interaction, or agent.program and agent.name=program"
        )
    if agent.uses_program and config.pipeline.mode != "sync":
        raise ValueError(
            f"agent.name=program runs in pipeline.mode=sync only for now, not {config.pipeline.mode!r}"
        )
