"""verl's algorithm keys that only make sense together: the policy loss and its clip settings
(with what makes a loss compute verl's numbers), the KL estimator, GDPO's normalisation,
DAPO's dynamic sampling and rollout correction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.verl import names
from tandem.verl.context import Context
from tandem.verl.keys import ACTOR, ALGO

VERL_VERSION = "0.9.1"  # the verl release the translation reproduces (docs/migrating-from-verl.md)


@dataclass(frozen=True)
class VerlBehaviour:
    """Settings that make one tandem loss compute verl's numbers where tandem differs on purpose
    (docs/algorithms.md, "Where tandem differs from verl").

    Attributes:
        settings: ``actor.policy_loss.*`` values (without the prefix).
        verl: the verl release whose ``core_algos.py`` these settings were checked against.
        why: what verl does that the settings reproduce.
    """

    settings: dict[str, Any]
    verl: str
    why: str


VERL_LOSS_BEHAVIOUR: dict[str, VerlBehaviour] = {
    # GSPO aggregates by loss_agg_mode from verl 0.9.1 on; up to 0.9.0 it forced seq-mean-token-mean.
    "gspo": VerlBehaviour({"log_ratio_clamp": None}, "0.9.1", "ppo_kl from the unclamped log-ratio"),
    "sapo": VerlBehaviour(
        {"pg_loss_agg_mode": "seq-mean-token-mean"},
        "0.9.1",
        "the policy term is seq-mean-token-mean whatever loss_agg_mode says",
    ),
    "clip_cov": VerlBehaviour({"log_ratio_clamp": None}, "0.9.1", "the log-ratio is never clamped"),
    "kl_cov": VerlBehaviour({"log_ratio_clamp": None}, "0.9.1", "the log-ratio is never clamped"),
    "gmpo": VerlBehaviour(
        {"log_ratio_clamp": None, "gmpo_is_weight_mean": "geometric"},
        "0.9.1",
        "no log-ratio clamp; one rollout-correction weight per sequence, their geometric mean",
    ),
    "dppo_tv": VerlBehaviour(
        {"dppo_zero_advantage_region": "negative"}, "0.9.1", "A = 0 is tested against the lower bound"
    ),
    "dppo_kl": VerlBehaviour(
        {"dppo_zero_advantage_region": "negative"}, "0.9.1", "A = 0 is tested against the lower bound"
    ),
}


def policy_loss(ctx: Context) -> None:
    """The loss's name and the clip settings it reads (DPPO reads them as divergence bounds)."""
    mode = ctx.get(f"{ACTOR}.policy_loss.loss_mode")
    name = names.tandem_name(f"{ACTOR}.policy_loss.loss_mode", mode)
    ctx.out["actor.policy_loss.name"] = name
    clip = ctx.get(f"{ACTOR}.clip_ratio")
    low = ctx.get(f"{ACTOR}.clip_ratio_low", 0.2)
    high = ctx.get(f"{ACTOR}.clip_ratio_high", 0.2)
    low = float(clip if low is None else low)
    high = float(clip if high is None else high)
    if ctx.set_by_user(f"{ACTOR}.clip_ratio") and not (
        ctx.set_by_user(f"{ACTOR}.clip_ratio_low") or ctx.set_by_user(f"{ACTOR}.clip_ratio_high")
    ):
        ctx.notes.append(
            f"{ACTOR}.clip_ratio={clip}: verl's losses read clip_ratio_low/high ({low}, {high}) and use "
            "clip_ratio only where those are null; so does this translation"
        )
    cap = ctx.get(f"{ACTOR}.clip_ratio_c")
    if name.startswith("dppo_"):
        ctx.out["actor.policy_loss.dppo_divergence_low"] = low
        ctx.out["actor.policy_loss.dppo_divergence_high"] = high
        ctx.out["actor.policy_loss.dppo_ratio_cap"] = 20.0 if cap is None else float(cap)
    else:
        ctx.out["actor.policy_loss.clip_ratio_low"] = low
        ctx.out["actor.policy_loss.clip_ratio_high"] = high
        ctx.out["actor.policy_loss.clip_ratio_c"] = None if cap is None else float(cap)
    ctx.out["actor.policy_loss.loss_agg_mode"] = names.tandem_name(
        f"{ACTOR}.loss_agg_mode", ctx.get(f"{ACTOR}.loss_agg_mode")
    )
    behaviour = VERL_LOSS_BEHAVIOUR.get(name)
    for setting, value in (behaviour.settings if behaviour else {}).items():
        ctx.out[f"actor.policy_loss.{setting}"] = value
    beta = ctx.get(f"{ACTOR}.policy_loss.dro_beta")
    if beta is not None:
        ctx.out["actor.policy_loss.dro_beta"] = float(beta)


def cispo_lower_clip(ctx: Context) -> None:
    """CISPO clips the ratio to ``[1 - low, 1 + high]``; a ratio is positive, so any ``low >= 1``
    (verl's CISPO example sets 10) never binds and equals tandem's largest allowed value, 1."""
    low = ctx.out.get("actor.policy_loss.clip_ratio_low")
    if ctx.out.get("actor.policy_loss.name") == "cispo" and low is not None and low > 1.0:
        ctx.out["actor.policy_loss.clip_ratio_low"] = 1.0
        ctx.notes.append(
            f"{ACTOR}.clip_ratio_low={low}: CISPO's lower bound 1 - {low} never binds on a positive ratio; "
            "tandem writes the same as clip_ratio_low=1.0"
        )


def kl_estimator(ctx: Context) -> None:
    """tandem has one KL estimator for both uses; verl has one per use."""
    loss_type = names.tandem_name(f"{ACTOR}.kl_loss_type", ctx.get(f"{ACTOR}.kl_loss_type"))
    penalty = names.tandem_name(f"{ALGO}.kl_penalty", ctx.get(f"{ALGO}.kl_penalty"))
    in_loss, in_reward = ctx.get(f"{ACTOR}.use_kl_loss"), ctx.get(f"{ALGO}.use_kl_in_reward")
    if in_loss and in_reward and loss_type != penalty:
        raise ValueError(
            f"{ACTOR}.kl_loss_type={ctx.get(f'{ACTOR}.kl_loss_type')} and {ALGO}.kl_penalty="
            f"{ctx.get(f'{ALGO}.kl_penalty')} differ; tandem uses one KL estimator for the loss and the "
            "reward penalty (algorithm.kl.estimator)"
        )
    ctx.out["algorithm.kl.estimator"] = penalty if in_reward and not in_loss else loss_type


def gdpo_normalisation(ctx: Context) -> None:
    """verl's trainer never passes ``norm_adv_by_std_in_grpo`` to GDPO: it always divides by the std."""
    if ctx.out.get("algorithm.adv_estimator") != "gdpo":
        return
    if ctx.set_by_user(f"{ALGO}.norm_adv_by_std_in_grpo") and not ctx.get(f"{ALGO}.norm_adv_by_std_in_grpo"):
        ctx.notes.append(
            f"{ALGO}.norm_adv_by_std_in_grpo=False: verl's GDPO divides by the std regardless; so does this translation"
        )
    ctx.out["algorithm.norm_adv_by_std"] = True


UNLIMITED_ROUNDS = 1000


def filter_groups(ctx: Context) -> None:
    """DAPO's dynamic sampling. verl's v1 trainer reads the metric from the reward function's
    fields (``score`` before the overlong penalty, ``acc``) and generates until the batch is full."""
    if not ctx.get(f"{ALGO}.filter_groups.enable"):
        return
    metric = ctx.get(f"{ALGO}.filter_groups.metric")
    metrics = {"acc": "acc", "score": "raw_score"}
    if metric not in metrics:
        raise ValueError(
            f"{ALGO}.filter_groups.metric={metric}: verl's trainer reads 'acc' or 'score' from the reward "
            "function's fields; set one"
        )
    ctx.out["algorithm.filter_groups.metric"] = metrics[metric]
    batches = int(ctx.get(f"{ALGO}.filter_groups.max_num_gen_batches") or 0)
    if batches <= 0:
        batches = UNLIMITED_ROUNDS
        ctx.notes.append(
            f"{ALGO}.filter_groups.max_num_gen_batches=0: verl generates until the batch is full; tandem "
            f"allows {UNLIMITED_ROUNDS} rounds"
        )
    ctx.out["algorithm.filter_groups.max_num_gen_batches"] = batches


def rollout_correction(ctx: Context) -> None:
    """Rollout correction's importance-sampling level and rejection bounds; verl's threshold
    ``LOW_HIGH`` (or one upper bound) bounds ``-log(rho)``, tandem bounds ``rho`` itself."""
    base = f"{ALGO}.rollout_correction"
    level = ctx.get(f"{base}.rollout_is")
    ctx.out["algorithm.rollout_correction.is_level"] = names.tandem_name(f"{base}.rollout_is", level)
    rejection = ctx.get(f"{base}.rollout_rs")
    ctx.out["algorithm.rollout_correction.rejection"] = names.tandem_name(f"{base}.rollout_rs", rejection)
    threshold = ctx.get(f"{base}.rollout_rs_threshold")
    if rejection is None:
        return
    if threshold is None:
        raise ValueError(
            f"{base}.rollout_rs={rejection} needs {base}.rollout_rs_threshold (verl requires one too)"
        )
    low, _, high = str(threshold).partition("_")
    try:
        lower, upper = (float(low), float(high)) if high else (1.0 / float(low), float(low))
    except ValueError:
        raise ValueError(
            f"{base}.rollout_rs_threshold={threshold}: expected 'LOW_HIGH' or one upper bound"
        ) from None
    # verl bounds -log(rho) by [log LOW, log HIGH]: rho = pi_old / pi_rollout lies in [1/HIGH, 1/LOW]
    ctx.out["algorithm.rollout_correction.rejection_low"] = 1.0 / upper
    ctx.out["algorithm.rollout_correction.rejection_high"] = 1.0 / lower
