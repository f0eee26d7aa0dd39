"""Online DPO (``actor.objective=preference``): each prompt's best- and worst-scored responses form
a pair, the plan's passes run over the pairs (the reference's log-probs, when the loss compares to
it), and the actor takes one preference-loss step.

With ``dataplane.enabled`` the pairs are references: the rows are picked from the per-row scores,
the pair columns ride inline, the passes and the update's ranks fetch their rows' fields and
make the per-token ``loss_mask`` and the reference's sums themselves
(:mod:`tandem.rl.preference_pairs`); the controller handles no per-token byte."""

from __future__ import annotations

from typing import Any

from tandem.algos.preference import UNPAIRED_LOSSES, PreferenceLossConfig
from tandem.dataplane import BatchRef
from tandem.protocol import Batch
from tandem.rl.metrics import timed
from tandem.rl.preference_pairs import (
    StoredPairs,
    best_worst_pairs,
    best_worst_rows,
    stored_pairs,
    with_reference_sums,
)
from tandem.rl.row_fields import SEQUENCE_REWARD, SEQUENCE_SCORE
from tandem.rl.stages.base import register_step_stage
from tandem.rl.stages.dynamic_sampling import filters_groups
from tandem.rl.stages.greedy_baseline import needs_greedy_baseline
from tandem.rl.step_data import BatchStep, RefStep, step_data

OBJECTIVE = "actor.objective=preference"


def prefers(config: Any) -> bool:
    """Whether the run is online DPO (``actor.objective=preference``)."""
    return config.actor.objective == "preference"


def check_preference(config: Any, plan: Any) -> None:
    """Online DPO's constraints, named by key: groups of two or more responses, one optimizer step
    a step, no other draw filter or baseline, no KL term, no teacher, a paired loss."""
    if config.rollout.n < 2:
        raise ValueError(f"{OBJECTIVE} ranks each prompt's responses, so rollout.n must be at least 2")
    if config.mini_batch_prompts != config.data.train_batch_size:
        raise ValueError(
            f"{OBJECTIVE} takes one optimizer step per step; leave actor.ppo_mini_batch_size unset"
        )
    if filters_groups(config) or needs_greedy_baseline(config):
        raise ValueError(
            f"{OBJECTIVE} pairs responses itself: algorithm.filter_groups and the {config.algorithm.adv_estimator} "
            "baseline do not apply"
        )
    if config.algorithm.kl.use_kl_loss or config.algorithm.kl.use_kl_in_reward:
        raise ValueError(
            f"{OBJECTIVE}: the preference loss already measures the policy against the reference; "
            "turn algorithm.kl.use_kl_loss and use_kl_in_reward off"
        )
    if any(stage.name == "teacher" for stage in plan.passes):
        raise ValueError(
            "algorithm.distill.objective: online DPO (actor.objective=preference) trains on response pairs, "
            "not per-token advantages; distil with actor.objective=policy_gradient"
        )
    check_online_preference_loss(config.actor.preference)


def check_online_preference_loss(preference: PreferenceLossConfig) -> None:
    """What online DPO's pairs cannot take: unpaired losses (they need labelled single responses),
    and LD-DPO's and WPO's per-token weighting (its reference log-probs are plain sums)."""
    names = preference.names or (preference.name,)
    unpaired = [name for name in names if name in UNPAIRED_LOSSES]
    if unpaired:
        raise ValueError(
            f"{OBJECTIVE} pairs each prompt's best and worst responses; actor.preference {unpaired[0]!r} is an "
            "unpaired loss (tandem dpo trains it on labelled data)"
        )
    if preference.ld_alpha is not None or preference.use_weighting:
        key = "ld_alpha" if preference.ld_alpha is not None else "use_weighting"
        raise ValueError(
            f"{OBJECTIVE}: actor.preference.{key} weighs tokens, and online DPO scores its reference as plain "
            "sums; leave it unset (tandem dpo has it)"
        )


@register_step_stage(
    "preference",
    "update",
    applies=prefers,
    runs=("pass",),
    stored=True,  # the pairs are picked from per-row scores (references, with dataplane.enabled)
    rule=check_preference,
    old_log_probs=lambda config: "none",  # the loss compares to the reference, not to old log-probs
    reference=lambda config: config.actor.preference.needs_reference,  # a loss that has one
)
def preference(
    trainer: Any, batch: Batch | BatchRef, timings: dict[str, float]
) -> tuple[Batch, dict[str, float]]:
    """The pairs' preference update; returns the whole scored batch (for its statistics)."""
    config = trainer.config
    if isinstance(batch, BatchRef) or config.dataplane.enabled:
        data = step_data(batch, config.dataplane, True, trainer.workers)
        try:
            return _preference_on_references(trainer, data, timings)
        finally:
            data.release()
    batch = batch.assign(tensors={"token_level_rewards": batch["token_level_scores"]})  # no KL in the reward
    with timed(timings, "adv"):
        pairs, metrics = best_worst_pairs(batch, config.rollout.n, config.actor_dp_size)
    if pairs is None:  # no prompt scored its responses differently: nothing to prefer
        trainer.console.print(
            f"[yellow]step {trainer.step}: no prompt group has a preference; update skipped"
        )
        return batch, metrics
    data = BatchStep(pairs)
    for stage in trainer.plan.passes:
        stage(trainer, data, timings)
    pairs = with_reference_sums(data.batch) if "ref_log_probs" in data.batch else data.batch
    with timed(timings, "update_actor"):
        metrics.update(trainer.update_actor(pairs))
    return batch, metrics


def _preference_on_references(
    trainer: Any, data: RefStep, timings: dict[str, float]
) -> tuple[Batch, dict[str, float]]:
    """:func:`preference` on the step's references: the pairs' rows picked from the per-row scores,
    the reference's pass and the update on them (each rank fetching its rows)."""
    config, batch = trainer.config, data.batch
    stored = SEQUENCE_SCORE in batch  # the draw stayed where it was generated: only its scores here
    scores = batch[SEQUENCE_SCORE] if stored else batch["token_level_scores"].sum(-1)
    view = (  # no KL in the reward: the rewards are the scores
        batch.assign(tensors={SEQUENCE_REWARD: scores})
        if stored
        else batch.assign(tensors={"token_level_rewards": batch["token_level_scores"]})
    )
    with timed(timings, "adv"):
        rows, metrics = best_worst_rows(scores, config.rollout.n, config.actor_dp_size)
    if rows is None:
        trainer.console.print(
            f"[yellow]step {trainer.step}: no prompt group has a preference; update skipped"
        )
        return view, metrics
    pairs = StoredPairs(stored_pairs(data.first, rows), data)
    for stage in trainer.plan.passes:
        stage(trainer, pairs, timings)
    with timed(timings, "update_actor"):
        metrics.update(trainer.update_actor(pairs.for_update()))
    return view, metrics
