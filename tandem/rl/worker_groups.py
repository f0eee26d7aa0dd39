"""The RL run's worker groups, started before the first step: the actor's (with the critic and the
teacher in its processes when they are colocated), and the critic's, the teacher's and the reward
model's when they have pools of their own. Every group is closed with the run's exit stack."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from tandem.config.paths import check_workers_share_output_dir
from tandem.controller import Role, create_colocated_group, create_worker_group
from tandem.rl.config import MODEL_SOURCE, TrainConfig
from tandem.rl.critic_worker import CriticWorker
from tandem.rl.rewards.model_worker import RewardModelWorker
from tandem.rl.rewards.sources import RewardSources
from tandem.rl.step_data import use_data_stores
from tandem.rl.teacher_worker import TeacherWorker
from tandem.rl.worker import ActorRolloutRefWorker


@dataclass
class RLWorkerGroups:
    """The started groups: the actor's workers, the critic's and the teacher's (None when the run
    has none), and the policy's parameter count."""

    workers: Any
    critics: Any | None
    teachers: Any | None
    params: int


def start_worker_groups(
    config: TrainConfig,
    total_steps: int,
    output_dir: Path,
    rewards: RewardSources,
    groups: contextlib.ExitStack,
    console: Console,
) -> RLWorkerGroups:
    """Start the actor's workers (with the critic in their processes when it is colocated), the
    critic's and the reward model's groups when the run has them apart, all closed with
    ``groups``; the reward model's group scores for ``rewards``."""
    backend = config.trainer.backend
    colocated = config.uses_critic and config.critic.placement == "colocated"
    teacher_colocated = config.distills and config.teacher.placement == "colocated"
    roles = {"actor": Role(ActorRolloutRefWorker, (config,))}
    if colocated:  # in the actor's processes: group.actor.<m>, group.critic.<m>, group.teacher.<m>
        roles["critic"] = Role(CriticWorker, (config,))
    if teacher_colocated:
        roles["teacher"] = Role(TeacherWorker, (config,))
    critics = teachers = None
    if len(roles) > 1:
        fused = groups.enter_context(create_colocated_group(roles, config.resource_pool(), backend))
        workers = fused.actor
        critics = fused.critic if colocated else None
        teachers = fused.teacher if teacher_colocated else None
    else:
        workers = groups.enter_context(
            create_worker_group(ActorRolloutRefWorker, config.resource_pool(), backend, args=(config,))
        )
    check_workers_share_output_dir(workers, output_dir)
    params = workers.init_model(
        config.schedule_steps(total_steps, config.actor.ppo_epochs, config.mini_batch_prompts)
    )[0]
    if config.distills:
        teachers = _start_teacher(config, teachers, groups, console)
    if config.uses_critic and not colocated:  # a group of its own, with the actor's worker count
        critics = groups.enter_context(
            create_worker_group(CriticWorker, config.critic_resource_pool(), backend, args=(config,))
        )
        check_workers_share_output_dir(critics, output_dir)  # its checkpoints go there too
    if critics is not None:
        _start_critic(config, critics, total_steps, console)
    if MODEL_SOURCE in config.reward.sources:  # a pool of its own
        rewards.model_group = _start_reward_model(config, groups, console)
    if config.dataplane.enabled:
        use_data_stores([workers, critics, teachers], config.dataplane)
    return RLWorkerGroups(workers, critics, teachers, params)


def _start_critic(config: TrainConfig, critics: Any, total_steps: int, console: Console) -> None:
    """Build the critic's engines for the run's critic optimizer steps."""
    critic_steps = config.schedule_steps(total_steps, config.critic_epochs, config.critic_mini_batch_prompts)
    params_critic = critics.init_model(critic_steps)[0]
    console.print(
        f"critic: {params_critic / 1e6:.2f}M parameters, {config.world_size} worker(s), {config.critic.placement}"
    )


def _start_teacher(
    config: TrainConfig, teachers: Any | None, groups: contextlib.ExitStack, console: Console
) -> Any:
    """The teacher's ranks: the colocated role ``teachers``, or a worker group of its own
    (``teacher.placement=separate``) with the actor's worker count."""
    if teachers is None:
        teachers = groups.enter_context(
            create_worker_group(
                TeacherWorker, config.teacher_resource_pool(), config.trainer.backend, args=(config,)
            )
        )
    params = teachers.init_model()[0]
    console.print(
        f"teacher: {params / 1e6:.2f}M parameters from {config.teacher.model_path}, "
        f"{config.world_size} worker(s), {config.teacher.placement}"
    )
    return teachers


def _start_reward_model(config: TrainConfig, groups: contextlib.ExitStack, console: Console) -> Any:
    """The reward model's worker group (``reward.model.*``)."""
    model = config.reward.model
    scorers = groups.enter_context(
        create_worker_group(
            RewardModelWorker, config.reward_model_resource_pool(), config.trainer.backend,
            args=(model, config.trainer.device),
        )
    )  # fmt: skip
    params = scorers.init_model()[0]
    console.print(
        f"reward model: {params / 1e6:.2f}M parameters from {model.path}, {model.n_workers} worker(s)"
    )
    return scorers
