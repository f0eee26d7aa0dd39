"""verl's names for estimators, policy losses and KL types, and tandem's name for each.

One table per kind. The algorithms' tables come from tandem's registries, where verl's names are
aliases of the registered ones (:func:`registered_names`). A verl name missing from its table is
one tandem does not implement: the translation fails with a message naming the key and the value
(never a silent fallback).
"""

from __future__ import annotations

from tandem import algos
from tandem.registry import Registry
from tandem.rollout.engines import ROLLOUT_ENGINES as TANDEM_ROLLOUT_ENGINES


def registered_names(registry: Registry) -> dict[str, str]:
    """Every name ``registry`` answers to (its registered names and their aliases, verl's among
    them) and the registered name each stands for."""
    return {**{name: name for name in registry.names()}, **registry.aliases()}


ADVANTAGE_ESTIMATORS: dict[str, str] = registered_names(
    algos.ADVANTAGE_ESTIMATORS
)  # grpo_vectorized: grpo, ...

POLICY_LOSSES: dict[str, str] = registered_names(algos.POLICY_LOSSES)  # verl's vanilla is ppo, geo_mean gmpo

KL_ESTIMATORS: dict[str, str] = registered_names(algos.KL_ESTIMATORS)  # verl's low_var_kl is k3, mse k2, ...

LOSS_AGG_MODES: dict[str, str] = {mode: mode for mode in algos.LOSS_AGG_MODES}

KL_CONTROLLERS: dict[str, str] = {"fixed": "fixed", "adaptive": "adaptive"}

LR_SCHEDULES: dict[str, str] = {"constant": "constant", "cosine": "cosine"}

LOGGERS: dict[str, str] = {
    "console": "console",
    "wandb": "wandb",
    "tensorboard": "tensorboard",
    "mlflow": "mlflow",
    "file": "jsonl",
}

ROLLOUT_ENGINES: dict[str, str] = {name: name for name in TANDEM_ROLLOUT_ENGINES}

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
