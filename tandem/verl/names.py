"""verl's names for estimators, policy losses and KL types, and tandem's name for each.

One table per kind. A verl name missing from its table is one tandem does not implement:
the translation fails with a message naming the key and the value (never a silent fallback).
"""

from __future__ import annotations

ADVANTAGE_ESTIMATORS: dict[str, str] = {
    "gae": "gae",
    "grpo": "grpo",
    "grpo_vectorized": "grpo",  # the same math as grpo, vectorised
    "rloo": "rloo",
    "rloo_vectorized": "rloo",
    "reinforce_plus_plus": "reinforce_plus_plus",
    "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline",
    "remax": "remax",
    "opo": "opo",
    "grpo_passk": "grpo_passk",
    "gpg": "gpg",
    "gdpo": "gdpo",
    "optimal_token_baseline": "optimal_token_baseline",
}

POLICY_LOSSES: dict[str, str] = {
    "vanilla": "ppo",
    "gspo": "gspo",
    "sapo": "sapo",
    "gpg": "gpg",
    "clip_cov": "clip_cov",
    "kl_cov": "kl_cov",
    "geo_mean": "gmpo",
    "dppo_tv": "dppo_tv",
    "dppo_kl": "dppo_kl",
    "dro": "dro",
    "cispo": "cispo",
}

KL_ESTIMATORS: dict[str, str] = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
    "kl+": "k1+",
    "k1+": "k1+",
    "abs+": "abs+",
    "mse+": "k2",  # k2's gradient is already the KL's: verl treats k2+ as k2
    "k2+": "k2",
    "low_var_kl+": "k3+",
    "k3+": "k3+",
}

LOSS_AGG_MODES: dict[str, str] = {
    mode: mode
    for mode in (
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    )
}

KL_CONTROLLERS: dict[str, str] = {"fixed": "fixed", "adaptive": "adaptive"}

LR_SCHEDULES: dict[str, str] = {"constant": "constant", "cosine": "cosine"}

LOGGERS: dict[str, str] = {
    "console": "console",
    "wandb": "wandb",
    "tensorboard": "tensorboard",
    "mlflow": "mlflow",
    "file": "jsonl",
}

ROLLOUT_ENGINES: dict[str, str] = {"vllm": "vllm", "hf": "hf", "native": "native"}

ROLLOUT_IS_LEVELS: dict[str | None, str] = {None: "none", "token": "token", "sequence": "sequence"}

ROLLOUT_REJECTION: dict[str | None, str] = {
    None: "none",
    "token_k1": "token",  # -log r per token, ratio bounds
    "seq_sum_k1": "sequence",  # the sequence's summed log-ratio: bounds on the product of ratios
    "seq_mean_k1": "geometric",  # the mean log-ratio: bounds on the geometric mean ratio
}

TABLES: dict[str, dict] = {
    "algorithm.adv_estimator": ADVANTAGE_ESTIMATORS,
    "actor_rollout_ref.actor.policy_loss.loss_mode": POLICY_LOSSES,
    "actor_rollout_ref.actor.kl_loss_type": KL_ESTIMATORS,
    "algorithm.kl_penalty": KL_ESTIMATORS,
    "actor_rollout_ref.actor.loss_agg_mode": LOSS_AGG_MODES,
    "algorithm.kl_ctrl.type": KL_CONTROLLERS,
    "actor_rollout_ref.actor.optim.lr_scheduler_type": LR_SCHEDULES,
    "trainer.logger": LOGGERS,
    "actor_rollout_ref.rollout.name": ROLLOUT_ENGINES,
    "algorithm.rollout_correction.rollout_is": ROLLOUT_IS_LEVELS,
    "algorithm.rollout_correction.rollout_rs": ROLLOUT_REJECTION,
}


def tandem_name(key: str, value: object) -> str:
    """tandem's name for verl's ``value`` of ``key``; an unknown name is an error naming both."""
    table = TABLES[key]
    if value not in table:
        known = ", ".join(str(name) for name in table if name is not None)
        raise ValueError(f"{key}={value}: tandem does not implement this; it knows {known}")
    return table[value]
