"""The policy-loss contract: one input type, one config, one output type, one registry.

A policy loss maps per-token log-probabilities to this micro-batch's share of the global
scalar loss (see :mod:`tandem.algos.aggregation`) plus detached metrics. Losses never call
``.item()`` and never communicate; metrics are 0-D tensors local to the micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.algos.aggregation import LOSS_AGG_MODES, LossNormalizer, aggregate_loss
from tandem.algos.masked import masked_mean
from tandem.config.validation import check_choice, check_positive, check_range
from tandem.registry import Registry

LOG_RATIO_CLAMP = 20.0  # default bound on |log pi - log pi_old| before exp(), so ratios stay finite
ZERO_ADVANTAGE_REGIONS = ("inside", "negative")
IS_WEIGHT_MEANS = ("arithmetic", "geometric")


@dataclass(frozen=True)
class PolicyLossInput:
    """Per-token inputs of every policy loss.

    Attributes:
        log_probs: ``[B, R]`` log pi_theta(a_t|s_t) of the policy being trained (carries grad).
        old_log_probs: ``[B, R]`` log pi_old(a_t|s_t), the behaviour policy of the ratio.
        advantages: ``[B, R]`` advantage per token.
        response_mask: ``[B, R]`` 1 on tokens that count.
        rollout_is_weights: ``[B, R]`` detached rollout-correction weights multiplied into the
            per-token loss (see :mod:`tandem.algos.rollout_correction`), or None.
        normalizer: global token/sequence counts for split-invariant aggregation, or None
            for this batch's own counts.
        generator: random generator for losses that sample tokens (Clip-Cov); None uses
            the default one.
    """

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    rollout_is_weights: torch.Tensor | None = None
    normalizer: LossNormalizer | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.log_probs.shape)
        if self.log_probs.ndim != 2:
            raise ValueError(f"log_probs must be [B, R], got {shape}")
        for name in ("old_log_probs", "advantages", "response_mask", "rollout_is_weights"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} like log_probs")

    @property
    def mask(self) -> torch.Tensor:
        """The response mask in the dtype of the log-probs."""
        return self.response_mask.to(self.log_probs.dtype)


@dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of the policy losses (``actor.policy_loss.*`` in the trainer config).

    Attributes:
        name: registered loss name, see ``POLICY_LOSSES.names()``.
        loss_agg_mode: how per-token losses become a scalar (see ``aggregate_loss``).
        clip_ratio_low / clip_ratio_high: ratio clip ``[1 - low, 1 + high]`` (PPO, GSPO,
            CISPO, Clip-Cov); DAPO's clip-higher sets ``high > low``. GMPO clips the log-ratio
            to ``[-low, high]``.
        clip_ratio_c: dual-clip bound for negative advantages (PPO, arXiv:1912.09729); None disables.
        norm_length: the constant of ``seq-mean-token-sum-norm`` (None: the padded length R).
        sapo_tau_pos / sapo_tau_neg: SAPO gate temperatures for positive / negative advantages.
        clip_cov_ratio / clip_cov_lb / clip_cov_ub: Clip-Cov's fraction of tokens to detach and
            the covariance window they are drawn from.
        kl_cov_ratio / kl_cov_coef: KL-Cov's fraction of top-covariance tokens and penalty weight.
        dppo_divergence_low / dppo_divergence_high: DPPO's trust-region thresholds on the
            probability divergence (TV or binary KL) for negative / positive advantages.
        dppo_ratio_cap: DPPO's truncation of the detached importance ratio.
        dro_beta: DRO's weight of the quadratic log-ratio penalty; required (> 0) with ``name=dro``.
        pg_loss_agg_mode: aggregation of the policy-gradient term alone (None: ``loss_agg_mode``);
            the entropy and KL terms keep ``loss_agg_mode``. verl's ``gspo`` and ``sapo`` always
            aggregate that term with ``seq-mean-token-mean``.
        log_ratio_clamp: ``|log pi_theta - log pi_old|`` is clamped to this before use (None: not
            clamped, as verl leaves it in ``clip_cov``, ``kl_cov`` and ``geo_mean`` and in
            ``gspo``'s ``ppo_kl``). DRO never clamps.
        gmpo_is_weight_mean: how GMPO turns token rollout-correction weights into one weight per
            sequence: ``arithmetic`` token mean, or ``geometric`` mean (verl's ``geo_mean``).
        dppo_zero_advantage_region: which DPPO trust region a token with ``A = 0`` is tested
            against (it has no gradient either way; only ``pg_clipfrac`` changes): ``inside``
            (always inside) or ``negative`` (the ``A < 0`` bound, as verl does).
    """

    name: str = "ppo"
    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    norm_length: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 1.0
    dppo_divergence_low: float = 0.2
    dppo_divergence_high: float = 0.2
    dppo_ratio_cap: float = 20.0
    dro_beta: float | None = None
    pg_loss_agg_mode: str | None = None
    log_ratio_clamp: float | None = LOG_RATIO_CLAMP
    gmpo_is_weight_mean: str = "arithmetic"
    dppo_zero_advantage_region: str = "inside"

    def __post_init__(self) -> None:
        owner = "actor.policy_loss"
        object.__setattr__(self, "name", POLICY_LOSSES.canonical(self.name, f"{owner}.name"))
        check_choice(owner, "loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        check_range(owner, "clip_ratio_low", self.clip_ratio_low, 0.0, 1.0)
        check_range(owner, "clip_ratio_high", self.clip_ratio_high, low=0.0)
        if self.clip_ratio_c is not None:
            check_range(owner, "clip_ratio_c", self.clip_ratio_c, low=1.0, low_inclusive=False)
        if self.norm_length is not None:
            check_positive(owner, "norm_length", self.norm_length)
        for name in ("sapo_tau_pos", "sapo_tau_neg", "kl_cov_coef", "dppo_ratio_cap"):
            check_positive(owner, name, getattr(self, name))
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            check_range(owner, name, getattr(self, name), 0.0, 1.0, low_inclusive=False)
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(
                f"{owner}.clip_cov_lb={self.clip_cov_lb} must be below clip_cov_ub={self.clip_cov_ub}"
            )
        check_positive(owner, "dppo_divergence_low", self.dppo_divergence_low)
        check_positive(owner, "dppo_divergence_high", self.dppo_divergence_high)
        if self.name == "dro" and self.dro_beta is None:
            raise ValueError(f"{owner}.dro_beta must be set (> 0) when {owner}.name=dro")
        if self.dro_beta is not None:
            check_positive(owner, "dro_beta", self.dro_beta)
        if self.pg_loss_agg_mode is not None:
            check_choice(owner, "pg_loss_agg_mode", self.pg_loss_agg_mode, LOSS_AGG_MODES)
        if self.log_ratio_clamp is not None:
            check_positive(owner, "log_ratio_clamp", self.log_ratio_clamp)
        check_choice(owner, "gmpo_is_weight_mean", self.gmpo_is_weight_mean, IS_WEIGHT_MEANS)
        check_choice(
            owner, "dppo_zero_advantage_region", self.dppo_zero_advantage_region, ZERO_ADVANTAGE_REGIONS
        )


@dataclass(frozen=True)
class PolicyLossOutput:
    """``loss``: 0-D tensor with grad; ``metrics``: name -> detached 0-D tensor (e.g. ``pg_clipfrac``)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


PolicyLossFn = Callable[[PolicyLossInput, PolicyLossConfig], PolicyLossOutput]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register


def compute_policy_loss(inputs: PolicyLossInput, config: PolicyLossConfig) -> PolicyLossOutput:
    """Run the loss ``config.name``."""
    return POLICY_LOSSES.get(config.name)(inputs, config)


def finish_token_loss(
    loss_mat: torch.Tensor,
    inputs: PolicyLossInput,
    config: PolicyLossConfig,
    metrics: dict[str, torch.Tensor],
) -> PolicyLossOutput:
    """Apply rollout-correction weights, aggregate (``pg_loss_agg_mode``, else ``loss_agg_mode``) and
    add ``ppo_kl`` (unless ``metrics`` has its own)."""
    if inputs.rollout_is_weights is not None:
        loss_mat = loss_mat * inputs.rollout_is_weights.detach()
    mode = config.pg_loss_agg_mode or config.loss_agg_mode
    loss = aggregate_loss(loss_mat, inputs.response_mask, mode, inputs.normalizer, config.norm_length)
    return PolicyLossOutput(loss=loss, metrics={"ppo_kl": approx_kl(inputs, config), **metrics})


def log_ratio(inputs: PolicyLossInput, config: PolicyLossConfig) -> torch.Tensor:
    """``[B, R]`` ``log pi_theta - log pi_old``, clamped to ``±config.log_ratio_clamp`` when that is set
    (carries grad through ``log_probs`` where not clamped)."""
    difference = inputs.log_probs - inputs.old_log_probs
    if config.log_ratio_clamp is None:
        return difference
    return torch.clamp(difference, -config.log_ratio_clamp, config.log_ratio_clamp)


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` and where the clip is active.

    Shapes: ``ratio, advantages: [B, R]`` -> ``(loss [B, R], clipped [B, R] bool)``.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def approx_kl(inputs: PolicyLossInput, config: PolicyLossConfig) -> torch.Tensor:
    """Mean over valid tokens of ``log pi_old - log pi_theta`` (k1 estimate of KL(pi_old || pi_theta)),
    from the log-ratio as :func:`log_ratio` clamps it."""
    return masked_mean(-log_ratio(inputs, config).detach(), inputs.mask)


def detached_fraction(condition: torch.Tensor, inputs: PolicyLossInput) -> torch.Tensor:
    """Fraction of valid tokens where ``condition`` holds."""
    return masked_mean(condition.detach().to(inputs.log_probs.dtype), inputs.mask)
