"""``algorithm.*``: the advantage estimator, KL, rollout correction and DAPO's dynamic sampling."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    KLConfig,
    estimator_inputs,
    estimator_requirements,
)
from tandem.algos.distill import DistillConfig
from tandem.algos.rollout_correction import RolloutCorrectionConfig
from tandem.config.validation import check_choice, check_positive


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (``algorithm.filter_groups.*``): drop prompt groups whose n
    rewards are all equal (no learning signal) and generate more until the step is full.

    Attributes:
        enable: on/off.
        max_num_gen_batches: most generation rounds per step (then train on what there is).
        metric: what must differ within a group: ``score`` (the reward trained on, overlong
            penalty included), ``raw_score`` (the scorer's score before that penalty) or ``acc``
            (the scorer's accuracy; DAPO's choice in verl).
    """

    enable: bool = False
    max_num_gen_batches: int = 4
    metric: str = "score"

    def __post_init__(self) -> None:
        check_positive("algorithm.filter_groups", "max_num_gen_batches", self.max_num_gen_batches)
        check_choice("algorithm.filter_groups", "metric", self.metric, ["score", "raw_score", "acc"])


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantages, KL and rollout correction (``algorithm.*``).

    Attributes:
        adv_estimator: a registered advantage estimator (``tandem algos`` lists them).
        norm_adv_by_std: divide GRPO advantages by the group's std (False: Dr. GRPO).
        gamma / lam: discount and GAE lambda for the estimators that use them.
        gdpo_reward_keys: GDPO's reward components, by name: fields of the dict the reward
            function returns (each result must carry them all); empty: GDPO normalises the score.
        gdpo_reward_weights: GDPO's weight per key (empty: all 1).
        kl: reference-KL use (``kl.use_kl_loss`` for the actor loss, ``kl.use_kl_in_reward`` for a penalty).
        rollout_correction: TIS / MIS against the rollout-vs-trainer mismatch.
        filter_groups: DAPO dynamic sampling.
        distill: on-policy distillation from ``teacher.*`` (the teacher's per-token log-ratio as
            a dense advantage, weighted with the estimator's; :mod:`tandem.algos.distill`).
    """

    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    gdpo_reward_keys: tuple[str, ...] = ()
    gdpo_reward_weights: tuple[float, ...] = ()
    kl: KLConfig = field(default_factory=KLConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        canonical = ADVANTAGE_ESTIMATORS.canonical(self.adv_estimator, "algorithm.adv_estimator")
        object.__setattr__(self, "adv_estimator", canonical)
        self.advantage_config()  # validates the estimator's own settings, named algorithm.*

    def advantage_config(self) -> AdvantageConfig:
        return AdvantageConfig(
            estimator=self.adv_estimator,
            gamma=self.gamma,
            lam=self.lam,
            norm_adv_by_std=self.norm_adv_by_std,
            gdpo_reward_keys=tuple(self.gdpo_reward_keys),
            gdpo_reward_weights=tuple(self.gdpo_reward_weights),
        )

    @property
    def needs_reference(self) -> bool:
        return self.kl.use_kl_loss or self.kl.use_kl_in_reward

    @property
    def needs_values(self) -> bool:
        """The estimator reads a critic's values (``gae``): a critic is trained beside the actor."""
        return "values" in estimator_requirements(self.adv_estimator)

    @property
    def compares_groups(self) -> bool:
        """The estimator compares the n responses of each prompt (it reads group ids)."""
        return "group_ids" in estimator_requirements(self.adv_estimator)

    @property
    def needs_greedy_baseline(self) -> bool:
        """The estimator reads a per-sample baseline reward: the greedy response's (ReMax)."""
        return "reward_baselines" in estimator_requirements(self.adv_estimator)

    @property
    def reward_component_keys(self) -> tuple[str, ...]:
        """The reward components scoring must return for the estimator (``reward_components``), in order."""
        return (
            tuple(self.gdpo_reward_keys)
            if "reward_components" in estimator_inputs(self.adv_estimator)
            else ()
        )

    @property
    def advantages_need_old_log_probs(self) -> bool:
        """The estimator reads the old log-probs, so they exist before the update."""
        return "old_log_probs" in estimator_requirements(self.adv_estimator)

    @property
    def needs_sum_pi_squared(self) -> bool:
        """The estimator reads ``sum_v pi_old(v)^2`` per token (the optimal token baseline)."""
        return "sum_pi_squared" in estimator_requirements(self.adv_estimator)
