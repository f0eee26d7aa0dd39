"""Advantage estimators, registered by name (importing this package registers them all)."""

from tandem.algos.advantages import gae, gdpo, group, returns, token_baseline  # noqa: F401  (registration)
from tandem.algos.advantages.base import (
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

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageConfig",
    "AdvantageInput",
    "AdvantageOutput",
    "EstimatorSplit",
    "RowInput",
    "compute_advantage",
    "estimator_inputs",
    "estimator_requirements",
    "estimator_split",
    "register_advantage_estimator",
    "register_row_estimator",
    "register_token_estimator",
    "spread_row_advantages",
]
