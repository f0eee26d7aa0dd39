"""The per-token part of the step's advantages, run by each rank on its own rows of the stored step
(``ActorRolloutRefWorker.compute_advantage_part``; the controller's part is
:mod:`tandem.rl.ref_advantages`). Two parts, in order:

* :data:`REWARDS`: the token rewards (the KL penalty in the reward), the rollout correction's mask
  and weights and, for an estimator that works on tokens (``EstimatorSplit.part == "token"``: GAE,
  REINFORCE++, ReMax), its advantages and returns before any whitening. Back inline, per row:
  the sequence reward and valid-token count an outcome estimator needs, and the partials of every
  batch-wide statistic (metrics, whitening);
* :data:`POSITION_SUMS` (between the two, for ``EstimatorSplit.part == "positions"``: the optimal
  token baseline): the baseline's terms of this rank's rows summed per group and response position,
  back as a small ``{"groups": [g], "weighted": [g, R], "weights": [g, R]}`` (not stored; the
  controller adds the ranks' sums, :mod:`tandem.rl.ref_advantages`);
* :data:`SPREAD`: the final advantages: an outcome estimator's per-row advantage (from the
  controller) spread over each row's mask, or the token estimator's, whitened with the batch's
  statistics (from the controller) where the estimator whitens, or the optimal token baseline's
  from its group's baseline (a reference to the controller's table of them); then the teacher's
  signal when distilling. Back inline, the partials of the advantages' statistics.

Every tensor op here is per row, and the ones that make a step's tensors are those the
controller's path calls (:mod:`tandem.rl.advantages`, :mod:`tandem.algos`), so the rows come out as
that path makes them, in any split over ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.algos import AdvantageInput, estimator_split, spread_row_advantages
from tandem.algos.advantages.token_baseline import (
    otb_advantages,
    otb_group_sums,
    otb_path_terms,
    reward_to_go,
)
from tandem.algos.masked import whiten_with, whitening_terms
from tandem.algos.reductions import Terms, reduce_row_partials, reduce_rows
from tandem.pipeline.stored_rollout import LAST_SAMPLED
from tandem.protocol import Batch
from tandem.rl.advantages import final_advantages, token_rewards
from tandem.rl.row_fields import (
    OTB_BASELINE,
    OTB_GROUP,
    OTB_ZERO_FROM,
    PARTIAL_PREFIX,
    RESPONSE_TOKENS,
    ROW_ADVANTAGE,
    SEQUENCE_REWARD,
    SEQUENCE_SCORE,
)
from tandem.rl.scoring import token_level_scores

REWARDS, SPREAD, POSITION_SUMS = "rewards", "spread", "position_sums"
RAW_ADVANTAGES = (
    "raw_advantages"  # [B, R] a token estimator's advantages before whitening (between the parts)
)
WHITENING_TERMS, ADVANTAGE_TERMS, VALUE_TERMS = "whiten:", "advantages:", "values:"
PART_READS = (
    "response_mask",
    "token_level_scores",
    SEQUENCE_SCORE,
    LAST_SAMPLED,
    "old_log_probs",
    "ref_log_probs",
    "rollout_log_probs",
    "values",
    "teacher_log_probs",
    "reward_baselines",
    RAW_ADVANTAGES,
    ROW_ADVANTAGE,
    "token_level_rewards",
    "sum_pi_squared",
    "rollout_is_weights",
    OTB_GROUP,
    OTB_BASELINE,
    OTB_ZERO_FROM,
)  # every field either part may read; the controller sends each part only those it needs


def advantage_part(
    batch: Batch, part: str, algorithm: Any, kl_coef: float, whitening: tuple[float, float] | None
) -> Batch | dict[str, torch.Tensor]:
    """Part ``part`` (:data:`REWARDS`, :data:`POSITION_SUMS` or :data:`SPREAD`) of the advantages on
    ``batch``, this rank's rows; ``algorithm`` is the config's section, ``kl_coef`` the KL
    coefficient in the reward, ``whitening`` the batch's ``(mean, var)`` for a whitening
    estimator's spread. Returns the per-token outputs ``[b, R]`` and the per-row ones ``[b]`` (kept
    in the store and inline), or for :data:`POSITION_SUMS` the rows' sums (:func:`position_sums`)."""
    with torch.no_grad():
        if part == REWARDS:
            return _rewards(batch, algorithm, kl_coef)
        if part == POSITION_SUMS:
            return position_sums(batch)
        if part == SPREAD:
            return _spread(batch, algorithm, whitening)
    raise ValueError(f"advantage part {part!r}: choose {REWARDS!r}, {POSITION_SUMS!r} or {SPREAD!r}")


def _scores(batch: Batch) -> torch.Tensor:
    """``[b, R]`` the score on each row's last sampled token (stored, or spread from the row's score)."""
    if "token_level_scores" in batch:
        return batch["token_level_scores"]
    width = batch["response_mask"].shape[1]
    return token_level_scores(batch[SEQUENCE_SCORE], batch[LAST_SAMPLED], width)


def _rewards(batch: Batch, algorithm: Any, kl_coef: float) -> Batch:
    """The :data:`REWARDS` part on this rank's rows (the module docstring)."""
    rewards, mask, weights, terms = token_rewards(batch, _scores(batch), algorithm, kl_coef)
    config = algorithm.advantage_config()
    split = estimator_split(config.estimator)
    tensors = {"token_level_rewards": rewards}
    if mask is not batch["response_mask"]:
        tensors["response_mask"] = mask
    if weights is not None:
        tensors["rollout_is_weights"] = weights
    if split.part == "token":
        inputs = AdvantageInput(
            rewards,
            mask,
            reward_baselines=batch.get("reward_baselines"),
            rollout_is_weights=weights,
            values=batch.get("values"),
        )
        output = split.token(inputs, config)
        tensors[RAW_ADVANTAGES] = output.advantages
        if split.whiten(config):
            terms.update(
                {WHITENING_TERMS + k: v for k, v in whitening_terms(output.advantages, mask).items()}
            )
        if "values" in batch:  # the critic's targets
            tensors["returns"] = output.returns
            terms.update(value_terms(batch["values"], output.returns, mask))
    tensors[SEQUENCE_REWARD] = rewards.sum(-1)
    tensors[RESPONSE_TOKENS] = mask.to(rewards.dtype).sum(-1)
    return Batch(tensors).assign(tensors=partials(terms))


def _spread(batch: Batch, algorithm: Any, whitening: tuple[float, float] | None) -> Batch:
    """The :data:`SPREAD` part on this rank's rows (the module docstring)."""
    config = algorithm.advantage_config()
    mask = batch["response_mask"]
    advantages, tensors, terms = _unwhitened_advantages(batch, mask)
    if estimator_split(config.estimator).whiten(config):
        if whitening is None:
            raise ValueError(
                f"the estimator {config.estimator!r} whitens: its spread needs the batch's (mean, var)"
            )
        weights = mask.to(advantages.dtype)
        mean, var = (torch.tensor(v, dtype=advantages.dtype) for v in whitening)
        advantages = whiten_with(advantages, mean, var) * weights
    if ROW_ADVANTAGE in batch and "values" in batch:  # an outcome estimator's returns: a critic's targets
        tensors["returns"] = advantages
    advantages, distill = final_advantages(batch, advantages, mask, algorithm)
    terms.update(distill)
    terms.update(token_stats_terms(ADVANTAGE_TERMS, advantages, mask))
    return Batch({**tensors, "advantages": advantages}).assign(tensors=partials(terms))


def _unwhitened_advantages(
    batch: Batch, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor], Terms]:
    """The estimator's advantages ``[b, R]`` before any whitening: an outcome estimator's per-row
    advantage spread, a token estimator's (made by :data:`REWARDS`), or the optimal token
    baseline's from its group's baseline (then, with a critic, its returns and their terms)."""
    if ROW_ADVANTAGE in batch:
        return spread_row_advantages(batch[ROW_ADVANTAGE], mask), {}, {}
    if OTB_BASELINE not in batch:
        return batch[RAW_ADVANTAGES], {}, {}
    rewards = batch["token_level_rewards"]
    weights = mask.to(rewards.dtype)
    returns = reward_to_go(rewards, weights)
    advantages = otb_advantages(returns, weights, batch[OTB_BASELINE], batch[OTB_ZERO_FROM])
    if "values" not in batch:
        return advantages, {}, {}
    return advantages, {"returns": returns}, value_terms(batch["values"], returns, mask)


def position_sums(batch: Batch) -> dict[str, torch.Tensor]:
    """The optimal token baseline's terms of this rank's rows summed per group and response
    position (:func:`tandem.algos.advantages.token_baseline.otb_group_sums`, rows in order):
    ``groups [g]`` (the compact ids of ``otb_group [b]`` the rows hold, pad rows' -1 left out)
    and ``weighted``, ``weights`` ``[g, R]``."""
    rewards = batch["token_level_rewards"]
    mask = batch["response_mask"].to(rewards.dtype)
    _, weighted, weights = otb_path_terms(
        rewards, mask, batch["old_log_probs"], batch["sum_pi_squared"], batch.get("rollout_is_weights")
    )
    real = batch[OTB_GROUP] >= 0
    groups, local = torch.unique(batch[OTB_GROUP][real], return_inverse=True)
    weighted, weights = otb_group_sums(weighted[real], weights[real], local, len(groups))
    return {"groups": groups, "weighted": weighted, "weights": weights}


def partials(terms: Terms) -> dict[str, torch.Tensor]:
    """``terms`` reduced per row, named ``partial/<op>/<term>`` (``[b]`` each, inline; the op is how
    the controller reduces them over the rows: :func:`reduced_partials`)."""
    return {
        f"{PARTIAL_PREFIX}{op}/{name}": reduce_rows({name: (op, v)})[name] for name, (op, v) in terms.items()
    }


def reduced_partials(rows: Batch) -> dict[str, torch.Tensor]:
    """The partials in ``rows`` (every row of the step, from :func:`partials`) reduced over the
    rows: what each term reduced over the whole batch gives (:mod:`tandem.algos.reductions`)."""
    values, ops = {}, {}
    for key in rows.keys():
        if key.startswith(PARTIAL_PREFIX):
            op, name = key[len(PARTIAL_PREFIX) :].split("/", 1)
            values[name], ops[name] = rows[key], op
    return reduce_row_partials(values, ops)


def token_stats_terms(prefix: str, values: torch.Tensor, mask: torch.Tensor) -> Terms:
    """The terms of ``values [B, R]``'s mean, max and min over ``mask``'s tokens (the step's
    ``critic/<name>/*`` metrics)."""
    selected = mask.bool()
    values = values.float()
    big = torch.tensor(float("inf"))
    return {
        prefix + "count": ("sum", selected.float()),
        prefix + "total": ("sum", torch.where(selected, values, 0.0)),
        prefix + "max": ("max", torch.where(selected, values, -big)),
        prefix + "min": ("min", torch.where(selected, values, big)),
    }


def value_terms(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> Terms:
    """The terms of the critic's metrics (``critic/values/*``, ``critic/returns/*``,
    ``critic/vf_explained_var``): the values' and returns' statistics over the mask's tokens, and
    the float64 sums of the returns and of their errors ``returns - values`` for the variances."""
    return {
        **token_stats_terms(VALUE_TERMS + "values/", values, mask),
        **token_stats_terms(VALUE_TERMS + "returns/", returns, mask),
        **{VALUE_TERMS + "returns:" + k: v for k, v in whitening_terms(returns.float(), mask).items()},
        **{
            VALUE_TERMS + "errors:" + k: v
            for k, v in whitening_terms((returns - values).float(), mask).items()
        },
    }
