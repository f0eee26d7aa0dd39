"""verl's policy losses, KL estimators and some of its advantage estimators, re-derived from their
formulas for comparison tests (verl/trainer/ppo/core_algos.py of verl 0.9.1, the release
docs/migrating-from-verl.md targets; where an older release differs, the function says so).

Our own code, written from the definitions; it does not import verl. It keeps verl's
numerical details: ``masked_mean`` divides by ``count + 1e-8``, ``seq-mean-token-mean`` divides
each sequence by ``length + 1e-8``, whitening uses the Bessel-corrected variance, and each
loss clamps (or does not clamp) the log-ratio exactly where verl does. Every loss returns
``(loss, metrics)`` with verl's metric names (without the ``actor/`` prefix).
"""

from __future__ import annotations

import numpy as np
import torch


def masked_mean(values, mask):
    return (values * mask).sum() / (mask.sum() + 1e-8)


def masked_whiten(values, mask):
    """``(x - mean) / sqrt(var + 1e-8)`` with verl's mean and Bessel-corrected variance."""
    mean = masked_mean(values, mask)
    count = mask.sum()
    variance = masked_mean((values - mean) ** 2, mask) * count / (count - 1)
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def aggregate(loss_mat, mask, mode, norm_length=None):
    """verl's ``agg_loss`` on one micro-batch with no global counts (single rank)."""
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    if mode == "token-sum":
        return (loss_mat * mask).sum()
    lengths = mask.sum(-1)
    present = (lengths > 0).to(loss_mat.dtype)
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = ((loss_mat * mask).sum(-1) * present).sum() / present.sum()
        if mode == "seq-mean-token-sum-norm":
            loss = loss / (norm_length or mask.shape[-1])
        return loss
    if mode == "seq-mean-token-mean":
        return ((loss_mat * mask).sum(-1) / (lengths + 1e-8) * present).sum() / present.sum()
    raise ValueError(mode)


def _weighted(losses, weights):
    return losses if weights is None else losses * weights


def vanilla(old, lp, adv, mask, mode, low=0.2, high=0.2, dual=3.0, weights=None, norm_length=None):
    log_ratio = torch.clamp(lp - old, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    first, second = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    pessimistic = torch.maximum(first, second)
    third = -adv * dual
    capped = torch.min(third, pessimistic)
    losses = torch.where(adv < 0, capped, pessimistic)
    metrics = {
        "pg_clipfrac": masked_mean((second > first).to(lp.dtype), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
        "pg_clipfrac_lower": masked_mean(((pessimistic > third) & (adv < 0)).to(lp.dtype), mask),
    }
    return aggregate(_weighted(losses, weights), mask, mode, norm_length), metrics


def _dppo(old, lp, adv, mask, mode, valid_up, valid_down, cap, weights):
    log_ratio = torch.clamp(lp - old, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    valid = torch.where(adv > 0, valid_up, valid_down).detach().to(lp.dtype)  # A <= 0: the lower bound
    losses = -adv * torch.clamp(ratio, max=cap).detach() * lp * valid
    metrics = {
        "pg_clipfrac": masked_mean(1.0 - valid, mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
        "pg_clipfrac_lower": masked_mean((ratio > cap).to(lp.dtype) * valid, mask),
    }
    return aggregate(_weighted(losses, weights), mask, mode), metrics


def dppo_tv(old, lp, adv, mask, mode, low=0.2, high=0.2, cap=3.0, weights=None):
    moved = torch.exp(lp) - torch.exp(old)
    return _dppo(old, lp, adv, mask, mode, moved <= high, moved >= -low, cap, weights)


def dppo_kl(old, lp, adv, mask, mode, low=0.2, high=0.2, cap=3.0, weights=None):
    p, q = torch.exp(lp), torch.exp(old)
    binary_kl = q * (old - lp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
    up_ok = (binary_kl <= high) | (p <= q)
    down_ok = (binary_kl <= low) | (p >= q)
    return _dppo(old, lp, adv, mask, mode, up_ok, down_ok, cap, weights)


def gspo(old, lp, adv, mask, mode, low=3e-4, high=4e-4, weights=None):
    """Aggregated by ``mode`` (verl 0.9.1; up to 0.9.0 verl forced seq-mean-token-mean)."""
    log_ratio = lp - old
    lengths = mask.sum(-1).clamp(min=1)
    seq_log_ratio = (log_ratio * mask).sum(-1) / lengths
    token_log_ratio = torch.clamp(lp - lp.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(token_log_ratio)
    first, second = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    losses = torch.maximum(first, second)
    metrics = {
        "pg_clipfrac": masked_mean((second > first).to(lp.dtype), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
        "pg_clipfrac_lower": torch.zeros(()),
    }
    return aggregate(_weighted(losses, weights), mask, mode), metrics


def sapo(old, lp, adv, mask, mode, tau_pos=1.0, tau_neg=1.05, weights=None):
    """``mode`` is ignored: verl (0.9.1 included) aggregates SAPO with seq-mean-token-mean."""
    log_ratio = torch.clamp(lp - old, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, torch.tensor(tau_pos, dtype=lp.dtype), torch.tensor(tau_neg, dtype=lp.dtype))
    losses = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
    metrics = {
        "pg_clipfrac": torch.zeros(()),
        "ppo_kl": masked_mean(-log_ratio, mask),
        "pg_clipfrac_lower": torch.zeros(()),
    }
    return aggregate(_weighted(losses, weights), mask, "seq-mean-token-mean"), metrics


def gpg(old, lp, adv, mask, mode, weights=None):
    return aggregate(_weighted(-lp * adv, weights), mask, mode), {}


def clip_cov(
    old, lp, adv, mask, mode, low=0.2, high=0.2, ratio_k=2e-4, lb=1.0, ub=5.0, weights=None, pick=None
):
    """``pick(eligible_indices, k)`` chooses which eligible tokens lose their gradient (verl: a random
    permutation); the default takes all of them, which is what verl does whenever ``k`` covers them."""
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    first, second = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clipped_by_ppo = (second > first) & (mask > 0)
    cov = (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp.detach(), mask))
    cov = cov.detach().masked_fill(mask == 0, -torch.inf).masked_fill(clipped_by_ppo, -torch.inf)
    k = max(int(ratio_k * float(mask.sum())), 1)
    eligible = torch.nonzero((cov < ub) & (cov > lb) & (mask > 0))
    chosen = eligible[: min(k, len(eligible))] if pick is None else pick(eligible, k)
    keep = torch.ones_like(adv)
    keep[chosen[:, 0], chosen[:, 1]] = 0
    losses = torch.maximum(first, second) * keep
    metrics = {
        "pg_clipfrac": masked_mean((keep == 0).to(lp.dtype), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }
    return aggregate(_weighted(losses, weights), mask, mode), metrics


def kl_cov(old, lp, adv, mask, mode, ratio_k=2e-4, coef=0.1, weights=None):
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    losses = -adv * ratio
    penalised = -adv * ratio + coef * log_ratio.abs()
    valid = mask > 0
    flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    valid_adv, valid_lp = adv[valid].detach(), lp[valid].detach()
    if len(valid_adv):
        cov = (valid_adv - valid_adv.mean()) * (valid_lp - valid_lp.mean())
        top = torch.topk(cov, max(1, int(len(cov) * ratio_k)), largest=True).indices
        cells = flat_valid[top]
        rows, cols = cells // adv.shape[1], cells % adv.shape[1]
        losses = losses.index_put((rows, cols), penalised[rows, cols])
    metrics = {"ppo_kl": masked_mean(log_ratio.abs(), mask)}
    return aggregate(_weighted(losses, weights), mask, mode), metrics


def geo_mean(old, lp, adv, mask, mode, low=0.4, high=0.4, weights=None):
    """``mode`` is ignored; the loss is a plain mean over the micro-batch's rows (empty ones included)."""
    log_ratio = lp - old
    sign = torch.sign(adv)
    clamped = torch.clamp(log_ratio, -low, high)
    pessimistic = sign * torch.min(sign * log_ratio, sign * clamped)
    lengths = mask.sum(-1)
    ratio = torch.exp((pessimistic * mask).sum(-1) / (lengths + 1e-8))
    seq_adv = (adv * mask).sum(-1) / (lengths + 1e-8)
    losses = -seq_adv * ratio
    if weights is not None:
        losses = losses * torch.exp((torch.log(weights + 1e-10) * mask).sum(-1) / (lengths + 1e-8))
    clipped = log_ratio != clamped
    metrics = {
        "pg_clipfrac": masked_mean((clipped & (adv > 0)).to(lp.dtype), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
        "pg_clipfrac_lower": masked_mean((clipped & (adv < 0)).to(lp.dtype), mask),
    }
    return losses.mean(), metrics


def dro(old, lp, adv, mask, mode, beta=0.5, weights=None):
    log_ratio = lp - old
    losses = -(lp * adv - 0.5 * beta * log_ratio.square())
    return aggregate(_weighted(losses, weights), mask, mode), {"ppo_kl": masked_mean(-log_ratio, mask)}


def cispo(old, lp, adv, mask, mode, low=0.2, high=0.2, weights=None):
    log_ratio = torch.clamp(lp - old, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    losses = -clipped.detach() * adv * lp
    metrics = {
        "pg_clipfrac": masked_mean((ratio != clipped).to(lp.dtype), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
        "pg_clipfrac_lower": torch.zeros(()),
    }
    return aggregate(_weighted(losses, weights), mask, mode), metrics


# ---------------------------------------------------------------- KL
def kl_penalty(lp, ref, name):
    """verl's ``kl_penalty`` for every name it accepts, ``+`` variants included."""
    base = name.removesuffix("+")
    if base in ("kl", "k1"):
        value = lp - ref
    elif base == "abs":
        value = (lp - ref).abs()
    elif base in ("mse", "k2"):
        value = 0.5 * (lp - ref).square()
    elif base in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref - lp, -20, 20)
        value = torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -10, 10)
    else:
        raise ValueError(name)
    if not name.endswith("+") or base in ("mse", "k2"):
        return value
    gradient_path = 0.5 * (lp - ref).square()
    return gradient_path - gradient_path.detach() + value.detach()


# ---------------------------------------------------------------- advantages
def grpo(scores, index, norm_by_std=True, epsilon=1e-6):
    """verl's GRPO per sequence ``[B]``: a group of one has mean 0 and std 1."""
    out = scores.clone()
    for group in np.unique(index):
        rows = torch.as_tensor(np.nonzero(index == group)[0])
        members = scores[rows]
        mean, std = (
            (torch.tensor(0.0), torch.tensor(1.0)) if len(rows) == 1 else (members.mean(), members.std())
        )
        out[rows] = (members - mean) / (std + epsilon) if norm_by_std else members - mean
    return out


def gdpo(components, mask, index, weights=None, norm_by_std=True, epsilon=1e-6):
    """``components [B, K]``; GRPO per component, weighted sum, whitening over the mask."""
    weights = weights or [1.0] * components.shape[1]
    combined = sum(
        w * grpo(components[:, k], index, norm_by_std, epsilon).unsqueeze(-1) * mask
        for k, w in enumerate(weights)
    )
    return masked_whiten(combined, mask) * mask


def rloo(scores, index):
    """verl's loop RLOO per sequence ``[B]``: ``n/(n-1) (s_i - mean_g)``; a group of one keeps its score."""
    out = scores.clone()
    for group in np.unique(index):
        rows = torch.as_tensor(np.nonzero(index == group)[0])
        n = len(rows)
        if n > 1:
            out[rows] = (scores[rows] - scores[rows].mean()) * n / (n - 1)
    return out


def rloo_vectorized(scores, index):
    """verl's ``rloo_vectorized`` per sequence ``[B]``: ``(n s_i - sum_g) / (n - 1)``, and 0 for a group
    of one (its ``(c > 1)`` factor), where the loop version keeps the score."""
    out = torch.zeros_like(scores)
    for group in np.unique(index):
        rows = torch.as_tensor(np.nonzero(index == group)[0])
        n = len(rows)
        if n > 1:
            out[rows] = (n * scores[rows] - scores[rows].sum()) / (n - 1)
    return out


def gpg_advantage(scores, index, f_norm=1.0):
    """verl's GPG advantage per sequence ``[B]``: ``alpha (s_i - mean_g) / f_norm`` with
    ``alpha = B / max(1, number of non-zero scores)`` (a group of one: mean 0)."""
    alpha = len(scores) / max(1, int(torch.count_nonzero(scores)))
    out = scores.clone()
    for group in np.unique(index):
        rows = torch.as_tensor(np.nonzero(index == group)[0])
        mean = scores[rows].mean() if len(rows) > 1 else torch.tensor(0.0, dtype=scores.dtype)
        out[rows] = alpha * (scores[rows] - mean) / f_norm
    return out


def optimal_token_baseline(
    rewards, mask, index, old_log_probs, sum_pi_squared, is_weights=None, handle_zero_tail=True
):
    """verl's OTB. ``handle_zero_tail`` is an argument of verl's function (default True); verl's
    trainer never passes it, so a verl run always zeroes that tail."""
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    per_token = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if is_weights is not None:
        per_token = per_token * is_weights**2
    path = (per_token * mask).cumsum(-1)
    baselines = torch.zeros_like(returns)
    for group in np.unique(index):
        rows = np.nonzero(index == group)[0].tolist()
        if len(rows) == 1:
            continue
        g_mask = mask[rows]
        numerator = (returns[rows] * path[rows] * g_mask).sum(0)
        denominator = (path[rows] * g_mask).sum(0) + 1e-8
        baselines[rows] = (numerator / denominator).expand(len(rows), -1)
        lengths = g_mask.sum(-1)
        ordered = torch.sort(lengths).values
        longest, second = int(ordered[-1]), int(ordered[-2])
        at_longest = (lengths == longest).nonzero(as_tuple=True)[0]
        if handle_zero_tail and at_longest.numel() == 1 and longest > second:
            baselines[rows[int(at_longest[0])], second:] = 0.0
    return (returns - baselines) * mask, returns
