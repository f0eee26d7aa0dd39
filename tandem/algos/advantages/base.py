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
        reward_components: ``[B, K]`` the ``K`` reward components the reward function returned
            beside its score (GDPO normalises each one on its own).
        old_log_probs: ``[B, R]`` log pi_old(a_t|s_t) before the update (optimal token baseline).
        sum_pi_squared: ``[B, R]`` ``sum_v pi_old(v|s_t)^2`` of the predictive distribution at each
            response position, after the sampling temperature (optimal token baseline).
        rollout_is_weights: ``[B, R]`` rollout-correction importance weights, when computed.
    """

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    group_ids: torch.Tensor | None = None
    values: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None
    reward_components: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.token_level_rewards.shape)
        if self.token_level_rewards.ndim != 2:
            raise ValueError(f"token_level_rewards must be [B, R], got {shape}")
        if tuple(self.response_mask.shape) != shape:
            raise ValueError(f"response_mask has shape {tuple(self.response_mask.shape)}, expected {shape}")
        for name in ("values", "old_log_probs", "sum_pi_squared", "rollout_is_weights"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        for name in ("group_ids", "reward_baselines"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape[:1]:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({shape[0]},)")
        components = self.reward_components
        if components is not None and (components.ndim != 2 or components.shape[0] != shape[0]):
            raise ValueError(
                f"reward_components has shape {tuple(components.shape)}, expected ({shape[0]}, K)"
            )

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
        gdpo_reward_keys: names of the reward components GDPO normalises one by one (fields of
            the dict the reward function returns); empty: GDPO normalises the total score.
        gdpo_reward_weights: one weight per key for GDPO's weighted sum (empty: all 1).
    """

    estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    epsilon: float = 1e-6
    whiten_gae: bool = True
    gpg_f_norm: float = 1.0
    gdpo_reward_keys: tuple[str, ...] = ()
    gdpo_reward_weights: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        owner = "algorithm"
        check_range(owner, "gamma", self.gamma, 0.0, 1.0)
        check_range(owner, "lam", self.lam, 0.0, 1.0)
        check_positive(owner, "epsilon", self.epsilon)
        check_positive(owner, "gpg_f_norm", self.gpg_f_norm)
        object.__setattr__(self, "estimator", ADVANTAGE_ESTIMATORS.canonical(self.estimator, f"{owner}.estimator"))
        keys, weights = tuple(self.gdpo_reward_keys), tuple(self.gdpo_reward_weights)
        if len(set(keys)) != len(keys) or not all(isinstance(key, str) and key for key in keys):
            raise ValueError(f"{owner}.gdpo_reward_keys={list(keys)} must be distinct, non-empty field names")
        if weights and len(weights) != len(keys):
            raise ValueError(
                f"{owner}.gdpo_reward_weights has {len(weights)} entries but {owner}.gdpo_reward_keys has "
                f"{len(keys)} ({list(keys)}); give one weight per key, or none for all 1"
            )
        for weight in weights:
            check_range(owner, "gdpo_reward_weights", weight)
        if keys and "reward_components" not in estimator_inputs(self.estimator):
            readers = [
                name for name in ADVANTAGE_ESTIMATORS.names() if "reward_components" in estimator_inputs(name)
            ]
            raise ValueError(
                f"{owner}.gdpo_reward_keys={list(keys)} is set, but the estimator {self.estimator!r} "
                f"({owner}.adv_estimator) does not read reward components (these do: {readers})"
            )


@dataclass(frozen=True)
class AdvantageOutput:
    """``advantages [B, R]`` (0 outside the mask) and ``returns [B, R]`` (critic targets where one exists)."""

    advantages: torch.Tensor
    returns: torch.Tensor


AdvantageFn = Callable[[AdvantageInput, AdvantageConfig], AdvantageOutput]


ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")
_REQUIREMENTS: dict[str, tuple[str, ...]] = {}
_USES_IF_GIVEN: dict[str, tuple[str, ...]] = {}


def register_advantage_estimator(
    name: str,
    requires: tuple[str, ...] = (),
    uses_if_given: tuple[str, ...] = (),
    aliases: tuple[str, ...] = (),
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an estimator under ``name`` (and ``aliases``); ``requires`` names the optional
    inputs it must have, ``uses_if_given`` those it reads when present (and does without otherwise)."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGE_ESTIMATORS.register(name, aliases)(fn)
        _REQUIREMENTS[name] = requires
        _USES_IF_GIVEN[name] = uses_if_given
        return fn

    return decorator


def estimator_requirements(name: str) -> tuple[str, ...]:
    """The optional :class:`AdvantageInput` fields the estimator ``name`` must have (``group_ids``,
    ``reward_baselines``, ``values``, ``old_log_probs``, ``sum_pi_squared``): what a trainer must
    provide for it."""
    return _REQUIREMENTS[ADVANTAGE_ESTIMATORS.canonical(name)]  # an unknown name: an error naming the choices


def estimator_inputs(name: str) -> tuple[str, ...]:
    """Every optional :class:`AdvantageInput` field the estimator ``name`` reads: the required ones
    and those it uses when given (``reward_components``, ``rollout_is_weights``)."""
    return estimator_requirements(name) + _USES_IF_GIVEN[ADVANTAGE_ESTIMATORS.canonical(name)]


def compute_advantage(inputs: AdvantageInput, config: AdvantageConfig) -> AdvantageOutput:
    """Run the estimator ``config.estimator`` after checking it has the inputs it needs."""
    fn = ADVANTAGE_ESTIMATORS.get(config.estimator)
    missing = [name for name in _REQUIREMENTS[config.estimator] if getattr(inputs, name) is None]
    if missing:
        raise ValueError(f"advantage estimator {config.estimator!r} needs {missing} in its input")
    with torch.no_grad():
        return fn(inputs, config)
