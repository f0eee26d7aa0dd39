"""Engine settings that follow from the rest of an RL run's config, derived in one place.

The training and rollout engines have fields that the RL trainer decides from other keys:
the model directory, the device, the seed, the temperature the trainer's log-probs use, the
longest sequence the rollout must hold. A user value for one of those that differs from
what the trainer derives would be overwritten silently, so it is an error that names both
keys (:func:`check_derived_fields`, run when a :class:`~tandem.rl.config.TrainConfig` is
built). A field left at its default, or set to the derived value, is fine.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from tandem.engine.config import EngineConfig
from tandem.pipeline.runner import ReplicaPlan, replica_first_gpu
from tandem.pipeline.source import StepShape
from tandem.rollout.config import RolloutEngineConfig

if TYPE_CHECKING:
    from tandem.rl.config import TrainConfig


def _replace_derived(owner: str, given: Any, derived: dict[str, tuple[Any, str]]) -> Any:
    """``given`` with each ``name`` set to its derived value; a user value in the way is an error.

    ``derived`` maps a field name to ``(value, the key it follows)``.
    """
    defaults = type(given)()
    for name, (value, source) in derived.items():
        current = getattr(given, name)
        if current != getattr(defaults, name) and current != value:
            raise ValueError(
                f"{owner}.{name}={current!r} would be overwritten: it follows {source} "
                f"(here {value!r}); set {source} instead, or leave {owner}.{name} unset"
            )
    return dataclasses.replace(given, **{name: value for name, (value, _) in derived.items()})


def actor_engine_config(config: TrainConfig, device: str, strategy: str, schedule_steps: int) -> EngineConfig:
    """The actor's :class:`EngineConfig` for a worker on ``device`` (a bound device such as ``cuda:1``).

    ``schedule_steps`` fills ``total_steps`` (the learning-rate schedule's length) when the
    user left it at 0.
    """
    engine = config.actor.engine
    derived = _replace_derived(
        "actor.engine",
        engine,
        {
            "model_path": (config.model_path, "model_path"),
            "seed": (config.trainer.seed, "trainer.seed"),
            "logprob_temperature": (config.rollout.temperature, "rollout.temperature"),
            "router_replay": (config.actor.router_replay, "actor.router_replay"),
        },
    )
    return dataclasses.replace(
        derived,
        device=device,
        strategy=strategy,
        total_steps=engine.total_steps or schedule_steps,
    )


def critic_engine_config(
    config: TrainConfig, device: str, strategy: str, schedule_steps: int
) -> EngineConfig:
    """The critic's :class:`EngineConfig` for a worker on ``device``: a value head on
    ``critic.model_path`` (or the policy's directory), the run's seed, ``schedule_steps``
    filling ``total_steps`` when the user left it at 0."""
    engine = config.critic.engine
    derived = _replace_derived(
        "critic.engine",
        engine,
        {
            "model_path": (config.critic.model_path or config.model_path, "critic.model_path"),
            "seed": (config.trainer.seed, "trainer.seed"),
            "head": ("value", "the critic role"),
        },
    )
    return dataclasses.replace(
        derived, device=device, strategy=strategy, total_steps=engine.total_steps or schedule_steps
    )


def teacher_engine_config(config: TrainConfig, device: str, strategy: str) -> EngineConfig:
    """The teacher's :class:`EngineConfig` for a worker on ``device``: its log-prob passes on
    ``teacher.model_path`` at the rollout's temperature (as the student's), the run's seed."""
    derived = _replace_derived(
        "teacher.engine",
        config.teacher.engine,
        {
            "model_path": (config.teacher.model_path, "teacher.model_path"),
            "seed": (config.trainer.seed, "trainer.seed"),
            "logprob_temperature": (config.rollout.temperature, "rollout.temperature"),
        },
    )
    return dataclasses.replace(derived, device=device, strategy=strategy)


def rollout_engine_config(config: TrainConfig, device: str) -> RolloutEngineConfig:
    """The rollout engine's config with the run's longest sequence, seed and ``device`` filled in,
    and vLLM recording the experts when ``actor.router_replay=rollout`` replays them."""
    rollout = config.rollout.engine
    longest = (config.max_sequence_length, "data.max_prompt_length + rollout.max_response_length")
    seed = (config.trainer.seed, "trainer.seed")
    native = _replace_derived(
        "rollout.engine.native", rollout.native, {"max_model_len": longest, "seed": seed}
    )
    vllm = _replace_derived("rollout.engine.vllm", rollout.vllm, {"max_model_len": longest, "seed": seed})
    # Replay needs vLLM to record the experts; recording without replay still feeds the
    # trainer's moe/routing_disagreement, so a user's True stands either way.
    replays = config.actor.router_replay == "rollout"
    vllm = dataclasses.replace(vllm, record_routing=vllm.record_routing or replays)
    return dataclasses.replace(rollout, native=native, vllm=vllm).on_device(device)


def step_shape(config: TrainConfig) -> StepShape:
    """What one draw of prompt groups holds: ``data.train_batch_size`` prompts, ``rollout.n``
    responses each, sampled at ``rollout.temperature``, seeded from ``trainer.seed``."""
    rollout = config.rollout
    return StepShape(
        groups=config.data.train_batch_size,
        responses=rollout.n,
        sampling=rollout.sampling(rollout.temperature),
        seed=config.trainer.seed,
    )


def replica_plan(config: TrainConfig) -> ReplicaPlan:
    """What the asynchronous pipelines' rollout replicas need from the run's config."""
    backend = "ray" if config.trainer.backend == "ray" else "process"
    return ReplicaPlan(
        pipeline=config.pipeline,
        engine=rollout_engine_config(config, config.trainer.device),
        model_path=config.model_path,
        device=config.trainer.device,
        backend=backend,
        pool=config.rollout_resource_pool(),
        first_gpu=replica_first_gpu(
            config.pipeline,
            backend,
            config.trainer.device,
            config.workers_per_node,
            config.rollout.engine.gpus_per_engine,
        ),  # fmt: skip
        shape=step_shape(config),
        agent=config.agent if config.agent.enabled else None,
    )


def check_derived_fields(config: TrainConfig) -> None:
    """Raise ``ValueError`` naming the key when a user value would be overwritten by a derived one."""
    device = config.trainer.device
    for owner, given in (
        ("actor.engine", config.actor.engine),
        ("critic.engine", config.critic.engine),
        ("teacher.engine", config.teacher.engine),
        ("rollout.engine.native", config.rollout.engine.native),
        ("rollout.engine.vllm", config.rollout.engine.vllm),
        ("rollout.engine.hf", config.rollout.engine.hf),
    ):
        _replace_derived(owner, given, {"device": (device, "trainer.device")})
    actor_engine_config(config, device, config.actor.engine.strategy, 0)
    critic_engine_config(config, device, config.critic.engine.strategy, 0)
    teacher_engine_config(config, device, config.teacher.engine.strategy)
    rollout_engine_config(config, device)
