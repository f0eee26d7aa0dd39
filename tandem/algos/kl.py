"""KL divergence between the policy and a reference: estimators, penalties and controllers.

Estimators follow Schulman, "Approximating KL Divergence" (2020): with
``l = log pi_ref(a) - log pi(a)`` for ``a ~ pi``, ``k1 = -l``, ``k2 = l^2 / 2`` and
``k3 = exp(l) - 1 - l``. k1 and k3 are unbiased for KL(pi || pi_ref) but their gradients
are not the KL's gradient; k2's gradient is. The ``+`` variants are straight-through: the
value of k1, k3 or abs with the gradient of k2 (value ``kX``, gradient ``d k2``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.algos.aggregation import LossNormalizer, aggregate_loss
from tandem.algos.masked import masked_mean
from tandem.algos.reductions import Terms, reduce_whole
from tandem.config.validation import check_choice, check_positive, check_range
from tandem.registry import Registry

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


@KL_ESTIMATORS.register("k1", aliases=("kl",))
def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``log pi - log pi_ref`` per token. Shapes: ``[B, R], [B, R] -> [B, R]``."""
    return log_probs - ref_log_probs


@KL_ESTIMATORS.register("abs")
def kl_abs(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``|log pi - log pi_ref|`` per token. Shapes: ``[B, R], [B, R] -> [B, R]``."""
    return (log_probs - ref_log_probs).abs()


@KL_ESTIMATORS.register("k2", aliases=("mse", "mse+", "k2+"))
def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``(log pi - log pi_ref)^2 / 2`` per token. Shapes: ``[B, R], [B, R] -> [B, R]``."""
    return 0.5 * (log_probs - ref_log_probs).square()


@KL_ESTIMATORS.register("k3", aliases=("low_var_kl",))
def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Low-variance ``exp(l) - 1 - l`` with ``l = log pi_ref - log pi`` (clamped for stability).

    Shapes: ``[B, R], [B, R] -> [B, R]``.
    """
    log_ratio = torch.clamp(ref_log_probs - log_probs, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(log_ratio) - 1 - log_ratio, -K3_VALUE_CLAMP, K3_VALUE_CLAMP)


def _straight_through(value_fn: KLEstimator) -> KLEstimator:
    def estimator(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
        grad_path = kl_k2(log_probs, ref_log_probs)
        return grad_path - grad_path.detach() + value_fn(log_probs, ref_log_probs).detach()

    estimator.__doc__ = (
        f"Value of {value_fn.__name__}, gradient of k2 (straight-through). Shapes: [B, R] -> [B, R]."
    )
    return estimator


KL_ESTIMATORS.register("k1+", aliases=("kl+",))(_straight_through(kl_k1))
KL_ESTIMATORS.register("k3+", aliases=("low_var_kl+",))(_straight_through(kl_k3))
KL_ESTIMATORS.register("abs+")(_straight_through(kl_abs))


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate by the registered ``estimator``. Shapes: ``[B, R] -> [B, R]``."""
    return KL_ESTIMATORS.get(estimator)(log_probs, ref_log_probs)


@dataclass(frozen=True)
class KLConfig:
    """How a reference-policy KL enters training (``algorithm.kl_*`` / ``actor.kl_loss_*``).

    Attributes:
        use_kl_in_reward: subtract ``coef * KL`` from the token rewards (PPO/RLHF style).
        use_kl_loss: add ``kl_loss_coef * KL`` to the actor loss (GRPO style).
        estimator: registered estimator for the chosen use (``k1``, ``k2``, ``k3``, ``k3+``, ...).
        coef: initial coefficient of the reward penalty.
        controller: ``fixed`` or ``adaptive`` (Ziegler et al. 2019) for the reward penalty.
        target_kl / horizon: the adaptive controller's target and horizon.
        kl_loss_coef: weight of the KL loss term.
    """

    use_kl_in_reward: bool = False
    use_kl_loss: bool = False
    estimator: str = "k3"
    coef: float = 0.001
    controller: str = "fixed"
    target_kl: float = 0.1
    horizon: int = 10000
    kl_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "estimator", KL_ESTIMATORS.canonical(self.estimator, "algorithm.kl.estimator")
        )
        check_choice("algorithm.kl", "controller", self.controller, ["fixed", "adaptive"])
        check_range("algorithm.kl", "coef", self.coef, low=0.0)
        check_range("algorithm.kl", "kl_loss_coef", self.kl_loss_coef, low=0.0)
        check_positive("algorithm.kl", "target_kl", self.target_kl)
        check_positive("algorithm.kl", "horizon", self.horizon)


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef: float) -> None:
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593, sec. 2.2).

    ``e = clip(KL / target - 1, -0.2, 0.2)`` and ``beta <- beta * (1 + e * n_steps / horizon)``:
    the coefficient grows while the measured KL exceeds the target and shrinks below it.
    """

    def __init__(self, coef: float, target_kl: float, horizon: int) -> None:
        self.value = coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust the coefficient after ``n_steps`` samples at measured KL ``current_kl``."""
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(config: KLConfig) -> FixedKLController | AdaptiveKLController:
    """The controller named by ``config.controller``."""
    if config.controller == "adaptive":
        return AdaptiveKLController(config.coef, config.target_kl, config.horizon)
    return FixedKLController(config.coef)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    estimator: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token rewards with a KL penalty: ``r_t = score_t - coef * KL_t`` on valid tokens.

    Shapes: all ``[B, R]`` -> rewards ``[B, R]``. Metrics: ``kl`` (batch mean of each
    sequence's token-mean KL, the value an adaptive controller tracks) and ``kl_coef``.
    """
    rewards, terms = kl_penalty(
        token_level_scores, old_log_probs, ref_log_probs, response_mask, coef, estimator
    )
    return rewards, kl_penalty_metrics(reduce_whole(terms), coef, token_level_scores.dtype)


def kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    estimator: str,
) -> tuple[torch.Tensor, Terms]:
    """:func:`apply_kl_penalty`'s rewards ``[B, R]`` (row by row) and the terms of its metrics
    (:mod:`tandem.algos.reductions`: each sequence's token-mean KL ``[B]``)."""
    mask = response_mask.to(token_level_scores.dtype)
    kl = kl_estimate(old_log_probs, ref_log_probs, estimator) * mask
    rewards = token_level_scores - coef * kl
    return rewards, {"kl": ("mean", masked_mean(kl, mask, dim=-1))}


def kl_penalty_metrics(
    reduced: dict[str, torch.Tensor], coef: float, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``kl`` and ``kl_coef`` from the reduced terms of :func:`kl_penalty`."""
    return {"kl": reduced["kl"], "kl_coef": torch.tensor(coef, dtype=dtype)}


def compute_kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str,
    loss_agg_mode: str,
    normalizer: LossNormalizer | None = None,
) -> torch.Tensor:
    """KL(pi || pi_ref) as a loss term, aggregated like the policy loss. Shapes: ``[B, R]`` -> scalar."""
    return aggregate_loss(
        kl_estimate(log_probs, ref_log_probs, estimator), response_mask, loss_agg_mode, normalizer
    )
