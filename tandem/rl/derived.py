"""Engine settings that follow from the rest of an RL run's config, derived in one place.

The training and rollout engines have fields that the RL trainer decides from other keys:
the model directory, the device, the seed, the temperature the trainer's log-probs use, the
longest sequence the rollout must hold. A user value for one of those that differs from
what the trainer derives would be overwritten silently, so it is an error that names both
keys (:func:`check_derived_fields`, run when a :class:`~tandem.rl.config.TrainConfig` is
built). A field left at its default, or set to the derived value, is fine.

The seed recipe lives here too (:func:`derive_seed`): every seed of a run — sampling,
mini-batch shuffling — comes from ``trainer.seed`` and integers that say what it is for.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from tandem.engine.config import EngineConfig
from tandem.rollout.config import RolloutEngineConfig

if TYPE_CHECKING:
    from tandem.rl.config import TrainConfig

SEED_MODULUS = 2**61 - 1  # a Mersenne prime: seeds stay below 2**61, inside int64


def derive_seed(*parts: int) -> int:
    """A seed from integers (run seed, then what it is for: step, round, row, ...): distinct and reproducible."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part)) % SEED_MODULUS
    return value


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


def rollout_engine_config(config: TrainConfig, device: str) -> RolloutEngineConfig:
    """The rollout engine's config with the run's longest sequence, seed and ``device`` filled in."""
    rollout = config.rollout.engine
    longest = (config.max_sequence_length, "data.max_prompt_length + rollout.max_response_length")
    seed = (config.trainer.seed, "trainer.seed")
    native = _replace_derived(
        "rollout.engine.native", rollout.native, {"max_model_len": longest, "seed": seed}
    )
    vllm = _replace_derived("rollout.engine.vllm", rollout.vllm, {"max_model_len": longest, "seed": seed})
    return dataclasses.replace(rollout, native=native, vllm=vllm).on_device(device)


def check_derived_fields(config: TrainConfig) -> None:
    """Raise ``ValueError`` naming the key when a user value would be overwritten by a derived one."""
    device = config.trainer.device
    for owner, given in (
        ("actor.engine", config.actor.engine),
        ("critic.engine", config.critic.engine),
        ("rollout.engine.native", config.rollout.engine.native),
        ("rollout.engine.vllm", config.rollout.engine.vllm),
        ("rollout.engine.hf", config.rollout.engine.hf),
    ):
        _replace_derived(owner, given, {"device": (device, "trainer.device")})
    actor_engine_config(config, device, config.actor.engine.strategy, 0)
    critic_engine_config(config, device, config.critic.engine.strategy, 0)
    rollout_engine_config(config, device)
