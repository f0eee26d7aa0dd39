"""Rollout correction: measure and correct the train-inference probability mismatch.

The rollout engine samples from ``pi_rollout`` while the trainer computes ``pi_old`` for
the same tokens; numerical differences (kernels, dtypes) or stale weights make them
differ. With ``rho_t = pi_old(a_t) / pi_rollout(a_t)`` (computed in log space):

* truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training"): weights ``min(rho_t, C)`` per token, or
  ``min(prod_t rho_t, C)`` per sequence, multiplied into the per-token policy loss;
* masked importance sampling / rejection (MIS; IcePop, Ling team 2025; Liu et al. 2025,
  "When speed kills stability"): drop tokens, or whole sequences, whose ratio (token,
  sequence product or per-token geometric mean) leaves ``[low, high]``; a veto drops a
  sequence containing any token with ``rho_t`` below a threshold.

Diagnostics are always returned so every run reports the mismatch, even uncorrected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.algos.masked import masked_mean
from tandem.algos.reductions import Terms, reduce_whole
from tandem.config.finite import no_limit_at_inf
from tandem.config.validation import check_choice, check_finite, check_positive

MAX_LOG_WEIGHT = 20.0  # log-ratios are clamped here before exp() so weights stay finite


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """How to correct for the rollout/trainer mismatch (``algorithm.rollout_correction.*``).

    Attributes:
        is_level: ``none``, ``token`` or ``sequence`` truncated importance weights.
        is_threshold: the truncation ``C`` of the importance weights (``inf``: no truncation).
        rejection: ``none``, ``token``, ``sequence`` (product ratio) or ``geometric``
            (per-token geometric mean ratio) masking.
        rejection_low / rejection_high: the accepted ratio interval of the rejection
            (``rejection_high=inf``: no upper limit, only ratios below ``rejection_low`` are rejected).
        veto_threshold: drop a sequence with any token ratio below this (None: off).
    """

    is_level: str = "none"
    is_threshold: float = no_limit_at_inf(2.0)
    rejection: str = "none"
    rejection_low: float = 0.5
    rejection_high: float = no_limit_at_inf(2.0)
    veto_threshold: float | None = None

    def __post_init__(self) -> None:
        owner = "algorithm.rollout_correction"
        check_choice(owner, "is_level", self.is_level, ["none", "token", "sequence"])
        check_choice(owner, "rejection", self.rejection, ["none", "token", "sequence", "geometric"])
        check_positive(owner, "is_threshold", self.is_threshold, allow_inf=True)
        check_positive(owner, "rejection_low", self.rejection_low)
        check_finite(owner, "rejection_high", self.rejection_high, allow_inf=True)
        if self.rejection_high <= self.rejection_low:
            raise ValueError(
                f"{owner}.rejection_high={self.rejection_high} must exceed rejection_low={self.rejection_low}"
            )
        if self.veto_threshold is not None:
            check_positive(owner, "veto_threshold", self.veto_threshold)


@dataclass(frozen=True)
class RolloutCorrectionOutput:
    """``is_weights [B, R]`` (detached, None when ``is_level='none'``), the updated
    ``response_mask [B, R]`` (rejected tokens zeroed), ``metrics`` (``rollout_corr/*``) and the
    ``terms`` they are reduced from (:mod:`tandem.algos.reductions`; :func:`correction_metrics`
    turns the reduced terms into the metrics, wherever the rows were reduced)."""

    is_weights: torch.Tensor | None
    response_mask: torch.Tensor
    metrics: dict[str, torch.Tensor]
    terms: Terms


def compute_rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
) -> RolloutCorrectionOutput:
    """Importance weights, rejection mask and mismatch diagnostics.

    Every output but the metrics is per row: the rows of a batch can be corrected anywhere, in any
    split. Shapes: ``old_log_probs, rollout_log_probs, response_mask: [B, R]``.
    """
    old_log_probs = old_log_probs.detach()
    rollout_log_probs = rollout_log_probs.detach()
    mask = response_mask.to(old_log_probs.dtype)
    log_rho = torch.clamp(old_log_probs - rollout_log_probs, -MAX_LOG_WEIGHT, MAX_LOG_WEIGHT) * mask
    seq_log_rho = log_rho.sum(-1)
    lengths = mask.sum(-1)
    terms = mismatch_terms(old_log_probs, rollout_log_probs, mask)

    keep = mask.clone()
    if config.rejection == "token":
        rho = torch.exp(log_rho)
        keep = keep * ((rho >= config.rejection_low) & (rho <= config.rejection_high)).to(mask.dtype)
    elif config.rejection in ("sequence", "geometric"):
        seq_stat = seq_log_rho if config.rejection == "sequence" else seq_log_rho / lengths.clamp(min=1)
        seq_rho = torch.exp(torch.clamp(seq_stat, -MAX_LOG_WEIGHT, MAX_LOG_WEIGHT))
        accepted = (seq_rho >= config.rejection_low) & (seq_rho <= config.rejection_high)
        keep = keep * accepted.unsqueeze(-1).to(mask.dtype)
    if config.veto_threshold is not None:
        vetoed = ((torch.exp(log_rho) < config.veto_threshold) & (mask > 0)).any(-1)
        keep = keep * (~vetoed).unsqueeze(-1).to(mask.dtype)
        has_tokens = (lengths > 0).to(mask.dtype)
        terms.update(veto_rows=("sum", vetoed.to(mask.dtype) * has_tokens), veto_of=("sum", has_tokens))
    terms["kept"] = ("sum", keep * mask)

    weights = None
    if config.is_level == "token":
        raw = torch.exp(log_rho)
        weights = torch.clamp(raw, max=config.is_threshold) * keep
        terms.update(_weight_terms(raw, weights, keep, config.is_threshold))
    elif config.is_level == "sequence":
        raw_seq = torch.exp(torch.clamp(seq_log_rho, -MAX_LOG_WEIGHT, MAX_LOG_WEIGHT))
        seq_keep = (keep.sum(-1) > 0).to(mask.dtype)
        seq_weights = torch.clamp(raw_seq, max=config.is_threshold)
        weights = seq_weights.unsqueeze(-1) * keep
        terms.update(_weight_terms(raw_seq, seq_weights * seq_keep, seq_keep, config.is_threshold))
    return RolloutCorrectionOutput(
        is_weights=weights,
        response_mask=keep.to(response_mask.dtype),
        metrics=correction_metrics(reduce_whole(terms)),
        terms=terms,
    )


def mismatch_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Train-inference mismatch over valid tokens (``[B, R]`` inputs -> 0-D tensors).

    ``kl``: k1 estimate of KL(pi_rollout || pi_old) (tokens are drawn from pi_rollout);
    ``k3_kl``: its low-variance k3 estimate; ``max_abs_log_prob_diff``;
    ``ratio_mean``: mean of ``pi_old / pi_rollout``; ``ppl_ratio``: mean over sequences
    of trainer perplexity / rollout perplexity (1 when they agree).
    """
    return correction_metrics(reduce_whole(mismatch_terms(old_log_probs, rollout_log_probs, mask)))


def mismatch_terms(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> Terms:
    """The reductions :func:`mismatch_metrics` is made of (``[B, R]`` inputs; per-token and per-row terms)."""
    diff = (old_log_probs - rollout_log_probs) * mask
    log_rho = torch.clamp(diff, -MAX_LOG_WEIGHT, MAX_LOG_WEIGHT)
    has_tokens = (mask.sum(-1) > 0).to(mask.dtype)
    seq_mean_diff = masked_mean(diff, mask, dim=-1)
    return {
        "tokens": ("sum", mask),
        "neg_diff": ("sum", -diff * mask),
        "k3": ("sum", (torch.exp(log_rho) - 1 - log_rho) * mask),
        "max_abs_diff": ("max", diff.abs() * mask),
        "ratio": ("sum", torch.exp(log_rho) * mask),
        "ppl_ratio_rows": ("sum", torch.exp(-seq_mean_diff) * has_tokens),
        "rows_with_tokens": ("sum", has_tokens),
    }


def correction_metrics(reduced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``rollout_corr/*`` from the reduced terms of :func:`mismatch_terms` (and, after a
    correction, of :func:`compute_rollout_correction`'s others): 0-D tensors."""
    tokens = reduced["tokens"].clamp(min=1)
    metrics = {
        "rollout_corr/kl": reduced["neg_diff"] / tokens,
        "rollout_corr/k3_kl": reduced["k3"] / tokens,
        "rollout_corr/max_abs_log_prob_diff": reduced["max_abs_diff"],
        "rollout_corr/ratio_mean": reduced["ratio"] / tokens,
        "rollout_corr/ppl_ratio": reduced["ppl_ratio_rows"] / reduced["rows_with_tokens"].clamp(min=1),
    }
    if "veto_rows" in reduced:
        metrics["rollout_corr/veto_frac"] = reduced["veto_rows"] / reduced["veto_of"].clamp(min=1)
    if "kept" in reduced:
        metrics["rollout_corr/masked_frac"] = 1 - reduced["kept"] / tokens
    if "weight_count" in reduced:
        n = reduced["weight_count"].clamp(min=1)
        total = reduced["weight_total"]
        metrics.update(
            {
                "rollout_corr/is_weight_mean": total / n,
                "rollout_corr/is_weight_max": reduced["weight_max"],
                "rollout_corr/is_weight_min": reduced["weight_min"],
                # Normalised effective sample size (Kish): 1 when all weights are equal.
                "rollout_corr/is_ess": total.square() / (n * reduced["weight_squares"]).clamp(min=1e-12),
                "rollout_corr/is_clipped_frac": reduced["weight_clipped"] / n,
            }
        )
    return metrics


def _weight_terms(raw: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor, threshold: float) -> Terms:
    """The reductions of the importance weights' statistics over kept entries (tokens ``[B, R]``
    or sequences ``[B]``, all of one shape)."""
    big = torch.tensor(float("inf"), dtype=weights.dtype, device=weights.device)
    return {
        "weight_count": ("sum", keep),
        "weight_total": ("sum", weights * keep),
        "weight_max": ("max", torch.where(keep > 0, weights, -big)),
        "weight_min": ("min", torch.where(keep > 0, weights, big)),
        "weight_squares": ("sum", weights.square() * keep),
        "weight_clipped": ("sum", (raw > threshold).to(weights.dtype) * keep),
    }
