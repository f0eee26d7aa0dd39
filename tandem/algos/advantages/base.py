"""The advantage-estimator contract: one input type, one config, one output type, one registry."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.algos.masked import masked_whiten
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
        object.__setattr__(
            self, "estimator", ADVANTAGE_ESTIMATORS.canonical(self.estimator, f"{owner}.estimator")
        )
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


@dataclass(frozen=True)
class RowInput:
    """The per-row scalars an estimator of outcome rewards reads (part ``row`` of
    :class:`EstimatorSplit`): no per-token tensor.

    Attributes:
        scores: ``[B]`` each row's sequence score (the row sum of its token-level rewards).
        lengths: ``[B]`` each row's valid response tokens (``response_mask``'s row sum).
        group_ids: ``[B]`` int64 prompt group ids.
        reward_baselines: ``[B]`` per-sample baselines, when given.
        reward_components: ``[B, K]`` reward components, when given.
    """

    scores: torch.Tensor
    lengths: torch.Tensor
    group_ids: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None
    reward_components: torch.Tensor | None = None

    @staticmethod
    def of(inputs: AdvantageInput) -> RowInput:
        """The per-row scalars of a whole :class:`AdvantageInput`."""
        scores = inputs.scores
        return RowInput(
            scores,
            inputs.response_mask.to(scores.dtype).sum(-1),
            inputs.group_ids,
            inputs.reward_baselines,
            inputs.reward_components,
        )


RowAdvantageFn = Callable[[RowInput, AdvantageConfig], torch.Tensor]  # -> [B] one advantage per row


def _never(config: AdvantageConfig) -> bool:
    return False


@dataclass(frozen=True)
class EstimatorSplit:
    """Where an estimator's work can run when the step's tokens stay on the ranks (docs/data-plane.md):

    * ``row``: ``row(RowInput, config) -> [B]`` on per-row scalars (the controller), spread over
      each row's response mask (the ranks);
    * ``token``: ``token(AdvantageInput, config) -> AdvantageOutput`` per row (each rank on its
      own rows; exact, since it reads nothing across rows);
    * ``positions``: it reads other rows' tokens only through sums per group and response position
      (the optimal token baseline): each rank sums its rows' terms, the controller adds the
      ``[G, R]`` sums, the ranks finish row by row (the estimator's module has the pieces);
    * ``batch``: it reads other rows' tokens otherwise: only where the whole batch is.

    ``whiten(config)``: the advantages are then whitened over the batch's valid tokens (with
    statistics reduced from per-row sums where the rows are apart)."""

    part: str
    row: RowAdvantageFn | None = None
    token: AdvantageFn | None = None
    whiten: Callable[[AdvantageConfig], bool] = _never


ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")
_REQUIREMENTS: dict[str, tuple[str, ...]] = {}
_USES_IF_GIVEN: dict[str, tuple[str, ...]] = {}
_SPLITS: dict[str, EstimatorSplit] = {}
BATCH_ONLY = EstimatorSplit("batch")


def register_advantage_estimator(
    name: str,
    requires: tuple[str, ...] = (),
    uses_if_given: tuple[str, ...] = (),
    aliases: tuple[str, ...] = (),
    split: EstimatorSplit = BATCH_ONLY,
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an estimator under ``name`` (and ``aliases``); ``requires`` names the optional
    inputs it must have, ``uses_if_given`` those it reads when present (and does without otherwise),
    ``split`` where its parts can run (:class:`EstimatorSplit`; default: only on the whole batch)."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGE_ESTIMATORS.register(name, aliases)(fn)
        _REQUIREMENTS[name] = requires
        _USES_IF_GIVEN[name] = uses_if_given
        _SPLITS[name] = split
        return fn

    return decorator


def register_row_estimator(
    name: str,
    requires: tuple[str, ...] = (),
    uses_if_given: tuple[str, ...] = (),
    aliases: tuple[str, ...] = (),
    whiten: Callable[[AdvantageConfig], bool] = _never,
) -> Callable[[RowAdvantageFn], RowAdvantageFn]:
    """Register an estimator of one advantage per row from per-row scalars (``row``): the
    estimator is that advantage spread over each row's response mask (:func:`spread_row_advantages`)."""

    def decorator(row: RowAdvantageFn) -> RowAdvantageFn:
        @functools.wraps(row)
        def estimator(inputs: AdvantageInput, config: AdvantageConfig) -> AdvantageOutput:
            advantages = spread_row_advantages(row(RowInput.of(inputs), config), inputs.response_mask)
            return whitened(AdvantageOutput(advantages, advantages), inputs.response_mask, whiten(config))

        split = EstimatorSplit("row", row=row, whiten=whiten)
        register_advantage_estimator(name, requires, uses_if_given, aliases, split)(estimator)
        return row

    return decorator


def register_token_estimator(
    name: str,
    requires: tuple[str, ...] = (),
    uses_if_given: tuple[str, ...] = (),
    aliases: tuple[str, ...] = (),
    whiten: Callable[[AdvantageConfig], bool] = _never,
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an estimator computed row by row on tokens (``token``), then whitened over the
    batch's valid tokens when ``whiten(config)``."""

    def decorator(token: AdvantageFn) -> AdvantageFn:
        @functools.wraps(token)
        def estimator(inputs: AdvantageInput, config: AdvantageConfig) -> AdvantageOutput:
            return whitened(token(inputs, config), inputs.response_mask, whiten(config))

        split = EstimatorSplit("token", token=token, whiten=whiten)
        register_advantage_estimator(name, requires, uses_if_given, aliases, split)(estimator)
        return token

    return decorator


def spread_row_advantages(per_row: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``per_row [B]`` on each row's valid tokens: ``[B, R]``, 0 outside ``response_mask [B, R]``."""
    return per_row.unsqueeze(-1) * response_mask.to(per_row.dtype)


def whitened(output: AdvantageOutput, response_mask: torch.Tensor, whiten: bool) -> AdvantageOutput:
    """``output`` with its advantages whitened over the valid tokens of the whole batch (when
    ``whiten``; a row estimator's returns are its advantages, whitened too)."""
    if not whiten:
        return output
    mask = response_mask.to(output.advantages.dtype)
    advantages = masked_whiten(output.advantages, mask) * mask
    returns = advantages if output.returns is output.advantages else output.returns
    return AdvantageOutput(advantages, returns)


def estimator_split(name: str) -> EstimatorSplit:
    """Where the estimator ``name``'s parts can run (:class:`EstimatorSplit`)."""
    return _SPLITS[ADVANTAGE_ESTIMATORS.canonical(name)]


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
