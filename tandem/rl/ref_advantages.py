"""The step's advantages when its tokens stay in the data plane: per-row scalars on the controller,
per-token work on the actor's ranks (docs/data-plane.md, "The advantages on the ranks").

The controller fetches no per-token field. It calls the actor group's
``compute_advantage_part`` twice on references to the step's rows (each rank fetches only the
fields a part needs, of its own rows: :mod:`tandem.rl.rank_advantages`), and between the calls it
works on what came back inline, a few ``[B]`` scalars: the sequence rewards and valid-token counts
an outcome estimator's per-row advantage is made of (``EstimatorSplit.row``), and the per-row
partial sums, maxima and minima every batch-wide statistic (the metrics, a whitening's mean and
variance) is reduced from. The optimal token baseline (``EstimatorSplit.part == "positions"``)
reads other rows' tokens only through sums per group and response position: between the two
parts, a third call has each rank sum its rows' terms (:data:`POSITION_SUMS`), the controller adds
those ``[G, R]`` sums, puts the groups' baselines into its store as one block of ``G`` rows, and
the spread part's ranks fetch their groups' rows of it (a ``BatchRef`` of the step's rows indexing
the group rows). An estimator that reads other rows' tokens otherwise (``part == "batch"``), a
trainer whose ``compute_advantages`` is overridden and a plan with ``view`` stages keep the
controller's path (:meth:`tandem.rl.step_data.RefStep.view`).
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.algos import RowInput, estimator_requirements, estimator_split
from tandem.algos.advantages.token_baseline import otb_baselines, otb_zero_from
from tandem.algos.masked import compact_group_ids, whitening_stats
from tandem.dataplane import BatchRef
from tandem.dataplane import release as release_block
from tandem.pipeline.stored_rollout import LAST_SAMPLED
from tandem.protocol import Batch, group_ids_from_uids
from tandem.rl.advantages import KL_TERMS, advantage_metrics
from tandem.rl.rank_advantages import (
    ADVANTAGE_TERMS,
    POSITION_SUMS,
    RAW_ADVANTAGES,
    REWARDS,
    SPREAD,
    VALUE_TERMS,
    WHITENING_TERMS,
    reduced_partials,
)
from tandem.rl.row_fields import (
    OTB_BASELINE,
    OTB_GROUP,
    OTB_ZERO_FROM,
    RESPONSE_TOKENS,
    ROW_ADVANTAGE,
    SEQUENCE_REWARD,
    SEQUENCE_SCORE,
)
from tandem.rl.step_data import RefStep


def advantages_stay_on_ranks(data: Any, plan: Any, algorithm: Any, hooked: bool) -> bool:
    """Whether the step's advantages run on the ranks: its data is stored (a ``RefStep``), its plan
    has no ``view`` stage, its trainer's ``compute_advantages`` is not overridden (``hooked``) and
    its estimator's parts can run apart (``EstimatorSplit.part`` ``row``, ``token`` or ``positions``)."""
    estimator = algorithm.advantage_config().estimator
    return (
        isinstance(data, RefStep)
        and not plan.views
        and not hooked
        and estimator_split(estimator).part != "batch"
    )


def rank_advantages(
    data: RefStep, group: Any, algorithm: Any, kl_controller: Any
) -> tuple[Batch, dict[str, float], BatchRef]:
    """The advantages of ``data``'s rows computed by ``group``'s ranks (the module docstring):
    the controller's batch of the step (per-row scalars only, with ``sequence_reward [B]``), the
    advantage metrics, and the ``BatchRef`` the updates get. ``kl_controller`` is updated when the
    penalty is in the reward."""
    config = algorithm.advantage_config()
    split = estimator_split(config.estimator)
    step, coef = data.joined(), kl_controller.value
    rewards_input = step.select(_reads_of_rewards(step, algorithm, split.part))
    rewards = data.keep(
        group, group.compute_advantage_part(rewards_input, part=REWARDS, kl_coef=coef, whitening=None)
    )
    rows, reduced = rewards.scalars, reduced_partials(rewards.scalars)
    if algorithm.kl.use_kl_in_reward:
        kl_controller.update(float(reduced[KL_TERMS + "kl"]), len(step))
    spread_input = _spread_inputs(step, rewards, split.part)
    whitening = None
    if split.part == "row":  # each row's advantage, here; spread (and whitened) there
        per_row = _row_advantages(data.batch, rows, split, config)
        spread_input = _with_inline(spread_input, {ROW_ADVANTAGE: per_row})
        if split.whiten(config):
            whitening = _row_whitening(per_row, rows[RESPONSE_TOKENS])
    elif split.whiten(config):
        whitening = _floats(whitening_stats(_prefixed(reduced, WHITENING_TERMS), torch.float32))
    table = None
    if split.part == "positions":  # the optimal token baseline's sums per group and position
        spread_input, table = _with_position_baselines(data, group, step, rewards, spread_input, coef)
    try:
        spread = data.keep(
            group, group.compute_advantage_part(spread_input, part=SPREAD, kl_coef=coef, whitening=whitening)
        )
    finally:
        if table is not None:  # read by the spread part only
            table.release(release_block)
    reduced.update(reduced_partials(spread.scalars))
    metrics = advantage_metrics(reduced, coef, torch.float32)
    metrics.update(token_stats("critic/advantages", _prefixed(reduced, ADVANTAGE_TERMS)))
    metrics.update(critic_metrics(_prefixed(reduced, VALUE_TERMS)))
    made = [
        rewards.select([f for f in rewards.stored_fields() if f != RAW_ADVANTAGES]),
        spread.select(spread.stored_fields()),
    ]
    view = data.batch.assign(tensors={SEQUENCE_REWARD: rows[SEQUENCE_REWARD]})
    return view, metrics, data.for_updates_with(made)


def _with_inline(ref: BatchRef, tensors: dict[str, torch.Tensor]) -> BatchRef:
    """``ref`` with ``tensors`` (``[B]`` each) added to its inline scalars."""
    return BatchRef(ref.scalars.assign(tensors=tensors), ref.parts, ref.schema)


def _with_position_baselines(
    data: RefStep, group: Any, step: BatchRef, rewards: BatchRef, spread_input: BatchRef, coef: float
) -> tuple[BatchRef, BatchRef]:
    """``spread_input`` with each row's group baseline (a reference into a block of ``G`` rows the
    controller puts) and the column it stops at, inline; and that block's ``BatchRef``, to release.

    The ranks sum their rows' terms per group and position (:data:`POSITION_SUMS`); the controller
    adds the ranks' ``[g, R]`` sums in rank order (for a group whose rows one rank holds, exactly its
    sums, which are the whole batch's). The rows are padded here to a multiple of the group's size with rows
    marked ``-1`` (no rank counts them), so the dispatch pads none and the sums need no unpadding."""
    ids, num_groups = compact_group_ids(group_ids_from_uids(data.batch["uid"]))
    mask = rewards if "response_mask" in rewards.schema else step
    terms = [f for f in ("token_level_rewards", "rollout_is_weights") if f in rewards.schema]
    sums_input = mask.select(["response_mask"]).union(rewards.select(terms))
    sums_input = sums_input.union(step.select(["old_log_probs", "sum_pi_squared"]))
    padded, pad = sums_input.pad_to_divisor(group.world_size)
    marks = torch.cat([ids, ids.new_full((pad,), -1)])
    outputs = group.compute_advantage_part(
        _with_inline(padded, {OTB_GROUP: marks}), part=POSITION_SUMS, kl_coef=coef, whitening=None
    )
    width = rewards.schema["token_level_rewards"].shape[0]
    dtype = getattr(torch, rewards.schema["token_level_rewards"].dtype)
    weighted, weights = (
        torch.zeros(num_groups, width, dtype=dtype),
        torch.zeros(num_groups, width, dtype=dtype),
    )
    for sums in outputs:
        weighted.index_add_(0, sums["groups"], sums["weighted"])
        weights.index_add_(0, sums["groups"], sums["weights"])
    table = BatchRef.put(Batch({OTB_BASELINE: otb_baselines(weighted, weights)}), data.store)
    zero_from = otb_zero_from(rewards.scalars[RESPONSE_TOKENS], ids, num_groups, width)
    return _with_inline(spread_input.union(table[ids]), {OTB_ZERO_FROM: zero_from}), table


def _row_whitening(per_row: torch.Tensor, lengths: torch.Tensor) -> tuple[float, float]:
    """The mean and variance of ``per_row [B]`` spread over ``lengths [B]`` valid tokens each: the
    sums of :func:`tandem.algos.masked.whitening_terms` of the spread advantages, from per-row scalars."""
    tokens, values = lengths.to(torch.float64), per_row.to(torch.float64)
    sums = {
        "count": tokens.sum(),
        "total": (values * tokens).sum(),
        "squares": (values.square() * tokens).sum(),
    }
    return _floats(whitening_stats(sums, per_row.dtype))


def _reads_of_rewards(step: BatchRef, algorithm: Any, part: str) -> list[str]:
    """The fields of ``step`` the rewards part reads: the mask and the scores, the log-probs of the
    KL penalty and the rollout correction, and a token estimator's inputs."""
    wanted = ["response_mask", "token_level_scores" if "token_level_scores" in step else SEQUENCE_SCORE]
    wanted += [] if "token_level_scores" in step else [LAST_SAMPLED]
    if algorithm.kl.use_kl_in_reward:
        wanted += ["old_log_probs", "ref_log_probs"]
    if "old_log_probs" in step:
        wanted += ["old_log_probs", "rollout_log_probs"]
    if part == "token":
        wanted += ["values", "reward_baselines"]
    return [f for f in dict.fromkeys(wanted) if f in step]


def _spread_inputs(step: BatchRef, rewards: BatchRef, part: str) -> BatchRef:
    """The fields the spread part reads: the mask (the corrected one when the rewards part made
    it), a token estimator's raw advantages or, with a critic, the values an outcome estimator's
    returns need, and the student's and teacher's log-probs when distilling."""
    fields = {"token": [RAW_ADVANTAGES], "positions": ["token_level_rewards", "values"]}.get(
        part, ["values"]
    )  # an outcome estimator's returns, with a critic
    if "teacher_log_probs" in step:
        fields += ["teacher_log_probs", "old_log_probs" if "old_log_probs" in step else "rollout_log_probs"]
    mask = (rewards if "response_mask" in rewards.schema else step).select(["response_mask"])
    made = rewards.select([f for f in fields if f in rewards.schema])
    return mask.union(made).union(step.select([f for f in fields if f in step and f not in rewards.schema]))


def _row_advantages(batch: Batch, rows: Batch, split: Any, config: Any) -> torch.Tensor:
    """``[B]``: the outcome estimator's advantage of each row, from per-row scalars only."""
    inputs = RowInput(
        rows[SEQUENCE_REWARD],
        rows[RESPONSE_TOKENS],
        group_ids_from_uids(batch["uid"]),
        reward_baselines=batch.get("reward_baselines"),
        reward_components=batch.get("reward_components"),
    )
    missing = [
        name for name in estimator_requirements(config.estimator) if getattr(inputs, name, None) is None
    ]
    if missing:
        raise ValueError(f"advantage estimator {config.estimator!r} needs {missing} in its input")
    with torch.no_grad():
        return split.row(inputs, config)


def token_stats(prefix: str, reduced: dict[str, torch.Tensor]) -> dict[str, float]:
    """``<prefix>/mean``, ``/max``, ``/min`` over the tokens whose terms were reduced to ``reduced``
    (:func:`tandem.rl.rank_advantages.token_stats_terms`); nothing when there were none."""
    if not reduced or not float(reduced["count"]):
        return {}
    return {
        f"{prefix}/mean": float(reduced["total"] / reduced["count"]),
        f"{prefix}/max": float(reduced["max"]),
        f"{prefix}/min": float(reduced["min"]),
    }


def critic_metrics(reduced: dict[str, torch.Tensor]) -> dict[str, float]:
    """The critic's metrics (those :func:`tandem.rl.metrics.value_metrics` gives a whole batch) from
    the reduced :func:`tandem.rl.rank_advantages.value_terms`."""
    if not reduced or not float(reduced["values/count"]):
        return {}
    returns, errors = (_biased_var(_prefixed(reduced, name)) for name in ("returns:", "errors:"))
    explained = 1.0 - errors / returns if returns > 0 else 0.0
    return {
        **token_stats("critic/values", _prefixed(reduced, "values/")),
        **token_stats("critic/returns", _prefixed(reduced, "returns/")),
        "critic/vf_explained_var": float(explained),
    }


def _biased_var(sums: dict[str, torch.Tensor]) -> float:
    mean = sums["total"] / sums["count"]
    return float(((sums["squares"] - sums["total"] * mean) / sums["count"]).clamp(min=0))


def _prefixed(reduced: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in reduced.items() if k.startswith(prefix)}


def _floats(stats: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    return float(stats[0]), float(stats[1])
