"""The advantage-estimator contract: one input type, one config, one output type, one registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.config.validation import check_positive, check_range
from tandem.registry import Registry


@dataclass(frozen=True)
class AdvantageInput:
    """Everything any estimator may read; each estimator declares which optional parts it needs.

    Attributes:
        token_level_rewards: ``[B, R]`` reward on response tokens (an outcome reward sits on
            the last valid token; the sequence score is the row sum).
        response_mask: ``[B, R]`` 1 on tokens that are actions (0 on padding and on
            tool/observation tokens in multi-turn rollouts).
        group_ids: ``[B]`` int64 id of the prompt group (the n samples of one prompt share it).
        values: ``[B, R]`` critic values V(s_t) (GAE).
        reward_baselines: ``[B]`` per-sample baseline reward (ReMax: the greedy response's reward).
    """

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    group_ids: torch.Tensor | None = None
    values: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.token_level_rewards.shape)
        if self.token_level_rewards.ndim != 2:
            raise ValueError(f"token_level_rewards must be [B, R], got {shape}")
        if tuple(self.response_mask.shape) != shape:
            raise ValueError(f"response_mask has shape {tuple(self.response_mask.shape)}, expected {shape}")
        if self.values is not None and tuple(self.values.shape) != shape:
            raise ValueError(f"values has shape {tuple(self.values.shape)}, expected {shape}")
        for name in ("group_ids", "reward_baselines"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape[:1]:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({shape[0]},)")

    @property
    def scores(self) -> torch.Tensor:
        """``[B]`` sequence-level (outcome) score: the sum of the token-level rewards."""
        return self.token_level_rewards.sum(-1)


@dataclass(frozen=True)
class AdvantageConfig:
    """Settings of the advantage estimators (``algorithm.*`` in the trainer config).

    Attributes:
        estimator: registered name, see ``ADVANTAGE_ESTIMATORS.names()``.
        gamma: discount factor (GAE, REINFORCE++).
        lam: GAE lambda.
        norm_adv_by_std: divide group-centred scores by the group std (GRPO); False gives Dr. GRPO.
        epsilon: added to the std before dividing.
        whiten_gae: whiten GAE advantages over the batch's valid tokens (PPO practice).
        gpg_f_norm: the constant GPG divides its advantages by.
    """

    estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    epsilon: float = 1e-6
    whiten_gae: bool = True
    gpg_f_norm: float = 1.0

    def __post_init__(self) -> None:
        owner = "algorithm"
        check_range(owner, "gamma", self.gamma, 0.0, 1.0)
        check_range(owner, "lam", self.lam, 0.0, 1.0)
        check_positive(owner, "epsilon", self.epsilon)
        check_positive(owner, "gpg_f_norm", self.gpg_f_norm)
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"{owner}.estimator={self.estimator!r} is not registered; choose one of {ADVANTAGE_ESTIMATORS.names()}"
            )


@dataclass(frozen=True)
class AdvantageOutput:
    """``advantages [B, R]`` (0 outside the mask) and ``returns [B, R]`` (critic targets where one exists)."""

    advantages: torch.Tensor
    returns: torch.Tensor


AdvantageFn = Callable[[AdvantageInput, AdvantageConfig], AdvantageOutput]


ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")
_REQUIREMENTS: dict[str, tuple[str, ...]] = {}


def register_advantage_estimator(
    name: str, requires: tuple[str, ...] = ()
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an estimator under ``name``; ``requires`` names the optional inputs it reads."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGE_ESTIMATORS.register(name)(fn)
        _REQUIREMENTS[name] = requires
        return fn

    return decorator


def estimator_requirements(name: str) -> tuple[str, ...]:
    """The optional :class:`AdvantageInput` fields the estimator ``name`` reads (``group_ids``,
    ``reward_baselines``, ``values``): what a trainer must provide for it."""
    ADVANTAGE_ESTIMATORS.get(name)  # an unknown name is an error naming the choices
    return _REQUIREMENTS[name]


def compute_advantage(inputs: AdvantageInput, config: AdvantageConfig) -> AdvantageOutput:
    """Run the estimator ``config.estimator`` after checking it has the inputs it needs."""
    fn = ADVANTAGE_ESTIMATORS.get(config.estimator)
    missing = [name for name in _REQUIREMENTS[config.estimator] if getattr(inputs, name) is None]
    if missing:
        raise ValueError(f"advantage estimator {config.estimator!r} needs {missing} in its input")
    with torch.no_grad():
        return fn(inputs, config)
