"""Pure tensor math of RL post-training, chosen by name from registries.

* :mod:`~tandem.algos.advantages` — advantage estimators (``ADVANTAGE_ESTIMATORS``)
* :mod:`~tandem.algos.policy_losses` — policy losses (``POLICY_LOSSES``)
* :mod:`~tandem.algos.kl` — KL estimators (``KL_ESTIMATORS``), penalties, controllers
* :mod:`~tandem.algos.aggregation` — split-invariant loss aggregation
* :mod:`~tandem.algos.value` — clipped value loss and entropy term
* :mod:`~tandem.algos.rollout_correction` — TIS / MIS and mismatch diagnostics
* :mod:`~tandem.algos.reductions` — batch-wide statistics as named reductions (per row, or whole)
"""

from tandem.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInput,
    AdvantageOutput,
    EstimatorSplit,
    RowInput,
    compute_advantage,
    estimator_inputs,
    estimator_requirements,
    estimator_split,
    register_advantage_estimator,
    register_row_estimator,
    register_token_estimator,
    spread_row_advantages,
)
from tandem.algos.aggregation import LOSS_AGG_MODES, LossNormalizer, aggregate_loss
from tandem.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLConfig,
    apply_kl_penalty,
    build_kl_controller,
    compute_kl_loss,
    kl_estimate,
)
from tandem.algos.policy_losses import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossInput,
    PolicyLossOutput,
    compute_policy_loss,
    register_policy_loss,
)
from tandem.algos.rollout_correction import (
    RolloutCorrectionConfig,
    RolloutCorrectionOutput,
    compute_rollout_correction,
    mismatch_metrics,
)
from tandem.algos.value import compute_entropy_term, compute_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageConfig",
    "AdvantageInput",
    "AdvantageOutput",
    "EstimatorSplit",
    "FixedKLController",
    "KLConfig",
    "LossNormalizer",
    "PolicyLossConfig",
    "PolicyLossInput",
    "PolicyLossOutput",
    "RolloutCorrectionConfig",
    "RolloutCorrectionOutput",
    "RowInput",
    "aggregate_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "compute_advantage",
    "estimator_inputs",
    "estimator_requirements",
    "estimator_split",
    "compute_entropy_term",
    "compute_kl_loss",
    "compute_policy_loss",
    "compute_rollout_correction",
    "compute_value_loss",
    "kl_estimate",
    "mismatch_metrics",
    "register_advantage_estimator",
    "register_policy_loss",
    "register_row_estimator",
    "register_token_estimator",
    "spread_row_advantages",
]
