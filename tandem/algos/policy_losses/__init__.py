"""Policy losses, registered by name (importing this package registers them all)."""

from tandem.algos.policy_losses import (  # noqa: F401  (registration)
    covariance,
    dro,
    ppo,
    reinforce_style,
    sequence_ratio,
    soft_gate,
)
from tandem.algos.policy_losses.base import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossInput,
    PolicyLossOutput,
    compute_policy_loss,
    register_policy_loss,
)

__all__ = [
    "POLICY_LOSSES",
    "PolicyLossConfig",
    "PolicyLossInput",
    "PolicyLossOutput",
    "compute_policy_loss",
    "register_policy_loss",
]
