"""Advantage estimators, registered by name (importing this package registers them all)."""

from tandem.algos.advantages import gae, gdpo, group, returns, token_baseline  # noqa: F401  (registration)
from tandem.algos.advantages.base import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInput,
    AdvantageOutput,
    compute_advantage,
    estimator_inputs,
    estimator_requirements,
    register_advantage_estimator,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageConfig",
    "AdvantageInput",
    "AdvantageOutput",
    "compute_advantage",
    "estimator_inputs",
    "estimator_requirements",
    "register_advantage_estimator",
]
