"""Straightforward per-sample / per-token references written from each paper's formula.

Deliberately naive: Python loops over samples and tokens, Python floats for statistics,
lists for groups. The vectorised implementations in ``tandem.algos`` are checked against
these. Losses build their value from scalar torch ops so autograd gives a reference
gradient too.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch


def valid_positions(mask_row) -> list[int]:
    return [t for t, m in enumerate(mask_row.tolist()) if m > 0]


def scores_of(rewards) -> list[float]:
    return [float(sum(row)) for row in rewards.tolist()]


def groups_of(group_ids) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids.tolist()):
        groups[g].append(i)
    return groups


def mean(xs):
    return sum(xs) / len(xs)


def unbiased_std(xs):
    if len(xs) < 2:
        return 0.0
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def broadcast(per_sample: list[float], mask) -> torch.Tensor:
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i, value in enumerate(per_sample):
        for t in valid_positions(mask[i]):
            out[i, t] = value
    return out


def whiten_valid(values: torch.Tensor, mask) -> torch.Tensor:
    entries = [float(values[i, t]) for i in range(mask.shape[0]) for t in valid_positions(mask[i])]
    m = mean(entries) if entries else 0.0
    var = sum((x - m) ** 2 for x in entries) / (len(entries) - 1) if len(entries) > 1 else 0.0
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        for t in valid_positions(mask[i]):
            out[i, t] = (float(values[i, t]) - m) / math.sqrt(var + 1e-8)
    return out


# ---------------------------------------------------------------- advantages
def gae(rewards, values, mask, gamma, lam, whiten):
    """Textbook GAE run on the compressed sequence of action tokens of each sample."""
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    ret = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        pos = valid_positions(mask[i])
        r = [float(rewards[i, t]) for t in pos]
        v = [float(values[i, t]) for t in pos] + [0.0]
        running = 0.0
        for k in reversed(range(len(pos))):
            delta = r[k] + gamma * v[k + 1] - v[k]
            running = delta + gamma * lam * running
            adv[i, pos[k]] = running
            ret[i, pos[k]] = running + v[k]
    return (whiten_valid(adv, mask) if whiten else adv), ret


def grpo(rewards, mask, group_ids, norm_by_std, eps):
    s = scores_of(rewards)
    out = [0.0] * len(s)
    for members in groups_of(group_ids).values():
        xs = [s[i] for i in members]
        for i in members:
            if len(members) == 1:
                out[i] = s[i]
            elif norm_by_std:
                out[i] = (s[i] - mean(xs)) / (unbiased_std(xs) + eps)
            else:
                out[i] = s[i] - mean(xs)
    return broadcast(out, mask)


def rloo(rewards, mask, group_ids):
    s = scores_of(rewards)
    out = [0.0] * len(s)
    for members in groups_of(group_ids).values():
        for i in members:
            others = [s[j] for j in members if j != i]
            out[i] = s[i] - mean(others) if others else s[i]
    return broadcast(out, mask)


def opo(rewards, mask, group_ids):
    s = scores_of(rewards)
    lengths = [len(valid_positions(mask[i])) for i in range(len(s))]
    out = [0.0] * len(s)
    for members in groups_of(group_ids).values():
        total = sum(lengths[j] for j in members)
        baseline = sum(lengths[j] * s[j] for j in members) / total if len(members) > 1 and total > 0 else 0.0
        for i in members:
            out[i] = s[i] - baseline
    return broadcast(out, mask)


def reinforce_pp_baseline(rewards, mask, group_ids):
    s = scores_of(rewards)
    out = [0.0] * len(s)
    for members in groups_of(group_ids).values():
        m = mean([s[j] for j in members]) if len(members) > 1 else 0.0
        for i in members:
            out[i] = s[i] - m
    return whiten_valid(broadcast(out, mask), mask)


def grpo_passk(rewards, mask, group_ids, norm_by_std, eps):
    s = scores_of(rewards)
    out = [0.0] * len(s)
    for members in groups_of(group_ids).values():
        best = max(members, key=lambda j: (s[j], -j))  # highest score, lowest index among ties
        second = max(s[j] for j in members if j != best)
        gap = s[best] - second
        if norm_by_std:
            gap /= unbiased_std([s[j] for j in members]) + eps
        out[best] = gap
    return broadcast(out, mask)


def gpg(rewards, mask, group_ids, f_norm):
    s = scores_of(rewards)
    groups = groups_of(group_ids)
    degenerate = sum(len(m) for m in groups.values() if len(m) > 1 and len({s[j] for j in m}) == 1)
    alpha = len(s) / max(len(s) - degenerate, 1)
    out = [0.0] * len(s)
    for members in groups.values():
        m = mean([s[j] for j in members]) if len(members) > 1 else 0.0
        for i in members:
            out[i] = alpha * (s[i] - m) / f_norm
    return broadcast(out, mask)


def reinforce_pp(rewards, mask, gamma):
    ret = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        running = 0.0
        for t in reversed(valid_positions(mask[i])):
            running = float(rewards[i, t]) + gamma * running
            ret[i, t] = running
    return whiten_valid(ret, mask), ret


def remax(rewards, mask, baselines):
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        pos = valid_positions(mask[i])
        for t in pos:
            adv[i, t] = sum(float(rewards[i, u]) for u in pos if u >= t) - float(baselines[i])
    return adv


def gdpo(components, mask, group_ids, weights, norm_by_std, eps):
    """Per component: GRPO within each group; weighted sum; broadcast; whitened over valid tokens."""
    batch, count = components.shape
    combined = [0.0] * batch
    for k in range(count):
        column = [float(components[i, k]) for i in range(batch)]
        for members in groups_of(group_ids).values():
            xs = [column[i] for i in members]
            for i in members:
                if len(members) == 1:
                    normalised = column[i]
                elif norm_by_std:
                    normalised = (column[i] - mean(xs)) / (unbiased_std(xs) + eps)
                else:
                    normalised = column[i] - mean(xs)
                combined[i] += weights[k] * normalised
    return whiten_valid(broadcast(combined, mask), mask)


def optimal_token_baseline(rewards, mask, group_ids, old_log_probs, sum_pi_squared, is_weights=None):
    """OTB by its definition, one group, column and sample at a time."""
    batch, width = mask.shape
    returns = torch.zeros(batch, width, dtype=torch.float64)
    path = torch.zeros(batch, width, dtype=torch.float64)
    for i in range(batch):
        running = 0.0
        for t in reversed(range(width)):
            running += float(rewards[i, t]) * float(mask[i, t])
            returns[i, t] = running
        so_far = 0.0
        for t in range(width):
            if mask[i, t]:
                w = 1 - 2 * math.exp(float(old_log_probs[i, t])) + float(sum_pi_squared[i, t])
                if is_weights is not None:
                    w *= float(is_weights[i, t]) ** 2
                so_far += w
            path[i, t] = so_far
    advantages = torch.zeros(batch, width, dtype=torch.float64)
    for members in groups_of(group_ids).values():
        baseline = {i: [0.0] * width for i in members}
        if len(members) > 1:
            for t in range(width):
                num = sum(float(returns[j, t]) * float(path[j, t]) for j in members if mask[j, t])
                den = sum(float(path[j, t]) for j in members if mask[j, t]) + 1e-8
                for i in members:
                    baseline[i][t] = num / den
            lengths = {j: len(valid_positions(mask[j])) for j in members}
            ordered = sorted(lengths.values())
            longest = [j for j in members if lengths[j] == ordered[-1]]
            if len(longest) == 1 and ordered[-1] > ordered[-2]:
                for t in range(ordered[-2], width):
                    baseline[longest[0]][t] = 0.0
        for i in members:
            for t in valid_positions(mask[i]):
                advantages[i, t] = float(returns[i, t]) - baseline[i][t]
    return advantages, returns


# ---------------------------------------------------------------- aggregation
def aggregate(loss_terms: dict[tuple[int, int], torch.Tensor], mask, mode: str, norm_length=None):
    """Aggregate a dict {(i, t): scalar loss} of valid tokens by the mode's formula."""
    batch = mask.shape[0]
    seqs = [valid_positions(mask[i]) for i in range(batch)]
    nonempty = [i for i in range(batch) if seqs[i]]
    zero = torch.zeros((), dtype=torch.float64)
    if mode in ("token-mean", "token-sum"):
        n = sum(len(p) for p in seqs)
        total = sum((loss_terms[(i, t)] for i in nonempty for t in seqs[i]), zero)
        return total if mode == "token-sum" else total / max(n, 1)
    per_seq = []
    for i in nonempty:
        token_sum = sum((loss_terms[(i, t)] for t in seqs[i]), zero)
        if mode == "seq-mean-token-sum":
            per_seq.append(token_sum)
        elif mode == "seq-mean-token-mean":
            per_seq.append(token_sum / len(seqs[i]))
        elif mode == "seq-mean-token-sum-norm":
            per_seq.append(token_sum / (norm_length or mask.shape[1]))
    return sum(per_seq, zero) / max(len(nonempty), 1)


# ---------------------------------------------------------------- policy losses
def value(x) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def clamp(x, low=None, high=None):
    """Scalar clamp that, like torch.clamp, passes no gradient when it clamps."""
    if low is not None and value(x) < low:
        return x * 0 + low
    if high is not None and value(x) > high:
        return x * 0 + high
    return x


def log_ratio(lp, old, bound=20.0):
    """``lp - old`` clamped to ``±bound`` (None: unclamped)."""
    return lp - old if bound is None else clamp(lp - old, -bound, bound)


def ppo_token(lp, old, a, cfg):
    ratio = torch.exp(log_ratio(lp, old, cfg.log_ratio_clamp))
    loss = torch.maximum(-a * ratio, -a * clamp(ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high))
    if cfg.clip_ratio_c is not None and a < 0:
        loss = torch.minimum(loss, -a * cfg.clip_ratio_c + 0 * loss)
    return loss


def token_loss_reference(token_fn, log_probs, old, adv, mask, cfg, weights=None):
    terms = {}
    for i in range(mask.shape[0]):
        for t in valid_positions(mask[i]):
            term = token_fn(log_probs[i, t], float(old[i, t]), float(adv[i, t]), cfg)
            terms[(i, t)] = term * (float(weights[i, t]) if weights is not None else 1.0)
    return aggregate(terms, mask, cfg.loss_agg_mode, cfg.norm_length)


def gspo_reference(log_probs, old, adv, mask, cfg):
    terms = {}
    for i in range(mask.shape[0]):
        pos = valid_positions(mask[i])
        if not pos:
            continue
        seq_log_ratio = sum(value(log_probs[i, t]) - float(old[i, t]) for t in pos) / len(pos)
        for t in pos:
            # value s_i, gradient d log pi_t scaled by s_i
            lr = seq_log_ratio + (log_probs[i, t] - value(log_probs[i, t]))
            ratio = torch.exp(clamp(lr, high=10.0))
            a = float(adv[i, t])
            terms[(i, t)] = torch.maximum(
                -a * ratio, -a * clamp(ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
            )
    return aggregate(terms, mask, cfg.loss_agg_mode, cfg.norm_length)


def gmpo_reference(log_probs, old, adv, mask, cfg, weights=None):
    zero = torch.zeros((), dtype=torch.float64)
    per_seq = []
    for i in range(mask.shape[0]):
        pos = valid_positions(mask[i])
        if not pos:
            continue
        clipped_logs = []
        for t in pos:
            lr = log_ratio(log_probs[i, t], float(old[i, t]), cfg.log_ratio_clamp)
            clipped = clamp(lr, -cfg.clip_ratio_low, cfg.clip_ratio_high)
            a = float(adv[i, t])
            sign = (a > 0) - (a < 0)
            # pessimistic side: for A > 0 the smaller log-ratio, for A < 0 the larger one
            if sign > 0:
                clipped_logs.append(torch.minimum(lr, clipped))
            elif sign < 0:
                clipped_logs.append(torch.maximum(lr, clipped))
            else:
                clipped_logs.append(lr * 0)
        seq_adv = mean([float(adv[i, t]) for t in pos])
        seq_weight = 1.0
        if weights is not None and cfg.gmpo_is_weight_mean == "geometric":
            seq_weight = math.exp(mean([math.log(float(weights[i, t]) + 1e-10) for t in pos]))
        elif weights is not None:
            seq_weight = mean([float(weights[i, t]) for t in pos])
        per_seq.append(-seq_adv * seq_weight * torch.exp(sum(clipped_logs, zero) / len(pos)))
    return sum(per_seq, zero) / max(len(per_seq), 1)


def cispo_token(lp, old, a, cfg):
    weight = min(
        max(math.exp(value(log_ratio(lp, old, cfg.log_ratio_clamp))), 1 - cfg.clip_ratio_low),
        1 + cfg.clip_ratio_high,
    )
    return -weight * a * lp


def gpg_token(lp, old, a, cfg):
    return -a * lp


def sapo_token(lp, old, a, cfg):
    tau = cfg.sapo_tau_pos if a > 0 else cfg.sapo_tau_neg
    ratio = torch.exp(log_ratio(lp, old, cfg.log_ratio_clamp))
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1)) * a


def dppo_inside(kind, lp, old, a, cfg) -> bool:
    """Whether DPPO (``kind`` "tv" or "kl") keeps the token: p has not left the trust region in A's direction."""
    p, q = math.exp(value(lp)), math.exp(old)
    if kind == "tv":
        up, down = p - q > cfg.dppo_divergence_high, p - q < -cfg.dppo_divergence_low
    else:
        kl = q * (old - value(lp)) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
        up = p > q and kl > cfg.dppo_divergence_high
        down = p < q and kl > cfg.dppo_divergence_low
    if a > 0:
        return not up
    if a < 0 or cfg.dppo_zero_advantage_region == "negative":
        return not down
    return True


def dppo_token(kind, lp, old, a, cfg):
    weight = min(math.exp(value(log_ratio(lp, old, cfg.log_ratio_clamp))), cfg.dppo_ratio_cap)
    return -a * weight * lp * (1.0 if dppo_inside(kind, lp, old, a, cfg) else 0.0)


def dppo_tv_token(lp, old, a, cfg):
    return dppo_token("tv", lp, old, a, cfg)


def dppo_kl_token(lp, old, a, cfg):
    return dppo_token("kl", lp, old, a, cfg)


def dro_token(lp, old, a, cfg):
    return -(a * lp - 0.5 * cfg.dro_beta * (lp - old) ** 2)


def covariances(log_probs, adv, mask):
    cells = [(i, t) for i in range(mask.shape[0]) for t in valid_positions(mask[i])]
    mean_a = mean([float(adv[c]) for c in cells])
    mean_lp = mean([value(log_probs[c]) for c in cells])
    return {c: (float(adv[c]) - mean_a) * (value(log_probs[c]) - mean_lp) for c in cells}


def clip_cov_reference(log_probs, old, adv, mask, cfg, priorities):
    cov = covariances(log_probs, adv, mask)
    k = max(1, math.floor(cfg.clip_cov_ratio * len(cov)))
    eligible = []
    for c, cov_value in cov.items():
        lr = value(log_ratio(log_probs[c], float(old[c]), cfg.log_ratio_clamp))
        ratio, a = math.exp(lr), float(adv[c])
        clipped_by_ppo = -a * min(max(ratio, 1 - cfg.clip_ratio_low), 1 + cfg.clip_ratio_high) > -a * ratio
        if not clipped_by_ppo and cfg.clip_cov_lb < cov_value < cfg.clip_cov_ub:
            eligible.append(c)
    chosen = set(sorted(eligible, key=lambda c: -float(priorities[c]))[:k])
    terms = {}
    for c in cov:
        ratio = torch.exp(log_ratio(log_probs[c], float(old[c]), cfg.log_ratio_clamp))
        a = float(adv[c])
        loss = torch.maximum(-a * ratio, -a * clamp(ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high))
        terms[c] = loss * 0 if c in chosen else loss
    return aggregate(terms, mask, cfg.loss_agg_mode), len(chosen)


def kl_cov_reference(log_probs, old, adv, mask, cfg):
    cov = covariances(log_probs, adv, mask)
    k = max(1, math.floor(cfg.kl_cov_ratio * len(cov)))
    chosen = set(sorted(cov, key=lambda c: -cov[c])[:k])
    terms = {}
    for c in cov:
        lr = log_ratio(log_probs[c], float(old[c]), cfg.log_ratio_clamp)
        terms[c] = -float(adv[c]) * torch.exp(lr) + (cfg.kl_cov_coef * torch.abs(lr) if c in chosen else 0.0)
    return aggregate(terms, mask, cfg.loss_agg_mode)
