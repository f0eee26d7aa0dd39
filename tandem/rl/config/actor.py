"""``actor.*``: the policy's objective, loss, engine and offloading; online DPO's cross-checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.algos import (
    PolicyLossConfig,
)
from tandem.algos.preference import UNPAIRED_LOSSES, PreferenceLossConfig
from tandem.config.validation import check_choice, check_positive, check_range
from tandem.engine.config import ROUTER_REPLAY, EngineConfig
from tandem.engine.offload import OffloadConfig

if TYPE_CHECKING:
    from tandem.rl.config.train import TrainConfig


OBJECTIVES = ("policy_gradient", "preference")


@dataclass(frozen=True)
class ActorOffloadConfig(OffloadConfig):
    """What the colocated loop keeps on the CPU while it is not needed (``actor.offload.*``),
    so that generation, and the rollout engine's KV cache, get the GPU's memory.

    Attributes:
        params: the actor's parameters leave the GPU while it generates and come
            back before the next log-prob pass or update (verl's ``param_offload``).
        optimizer: the actor's optimizer state stays on the CPU except during the update
            (verl's ``optimizer_offload``).
        reference: the reference model stays on the CPU except while it computes log-probs
            (verl's ``ref.fsdp_config.param_offload``; with LoRA there is no separate reference).

    On the CPU there is nothing to offload and these change nothing. The results never depend
    on them: only where the state waits between phases changes.
    """

    reference: bool = False


@dataclass(frozen=True)
class ActorConfig:
    """The policy and its update (``actor.*``).

    Attributes:
        engine: the training engine. Its ``model_path``, ``device``, ``seed`` and
            ``logprob_temperature`` follow ``model_path``, ``trainer.device``, ``trainer.seed``
            and ``rollout.temperature`` (setting them here to something else is an error), its
            strategy follows ``trainer.n_workers``, and ``total_steps`` 0 means the run's
            optimizer-step count (see :mod:`tandem.rl.derived`).
        policy_loss: the policy loss (``actor.policy_loss.name``: a registered loss, ``tandem
            algos`` lists them) and its settings: ``loss_agg_mode``, ``clip_ratio_low`` /
            ``clip_ratio_high`` / ``clip_ratio_c``, and each loss's own knobs
            (:class:`~tandem.algos.PolicyLossConfig`).
        ppo_mini_batch_size: prompts per optimizer step (0: the whole step's batch, one update).
        ppo_epochs: passes over the step's batch.
        shuffle_mini_batches: reshuffle sequences between epochs.
        entropy_coeff: weight of an entropy bonus (0: off).
        recompute_old_log_probs: always run a separate forward for the old log-probs. By default
            a purely on-policy step (one epoch, one mini-batch, no KL penalty in the reward, no
            rollout correction, an advantage estimator that does not read them) takes them from
            the update's own forward (detached): the same values, one forward fewer. The
            rollout-vs-trainer mismatch is logged either way.
        objective: ``policy_gradient`` (advantages and ``policy_loss``) or ``preference``
            (online DPO: each prompt's best- and worst-scored responses form a pair, trained
            with ``preference``, one optimizer step per step; see docs/dpo.md).
        preference: the preference loss when ``objective=preference``
            (:class:`~tandem.algos.preference.PreferenceLossConfig`: ``name``, ``beta``, ...).
        offload: what the colocated loop keeps on the CPU between the phases that need it
            (:class:`ActorOffloadConfig`: ``params``, ``optimizer``, ``reference``).
        router_replay: a mixture-of-experts policy's routing in the trainer: ``off`` (the
            trainer routes each token itself) or ``rollout`` (rollout routing replay: the old
            log-prob and update forwards run the experts the rollout engine recorded for each
            token, weighted by the live router; needs the native, hf or vllm rollout engine, vLLM
            on a GPU). Sets ``actor.engine.router_replay`` and turns on
            ``rollout.engine.vllm.record_routing``; see docs/moe.md.
    """

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(lr=1e-6))
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    ppo_mini_batch_size: int = 0
    ppo_epochs: int = 1
    shuffle_mini_batches: bool = False
    entropy_coeff: float = 0.0
    recompute_old_log_probs: bool = False
    objective: str = "policy_gradient"
    preference: PreferenceLossConfig = field(default_factory=PreferenceLossConfig)
    offload: ActorOffloadConfig = field(default_factory=ActorOffloadConfig)
    router_replay: str = "off"

    def __post_init__(self) -> None:
        check_choice("actor", "objective", self.objective, OBJECTIVES)
        check_choice("actor", "router_replay", self.router_replay, ROUTER_REPLAY)
        check_range("actor", "ppo_mini_batch_size", self.ppo_mini_batch_size, low=0)
        check_positive("actor", "ppo_epochs", self.ppo_epochs)
        check_range("actor", "entropy_coeff", self.entropy_coeff, low=0.0)


ROUTING_RECORDERS = ("native", "hf", "vllm")  # the rollout engines that return each token's experts


def check_router_replay(config: TrainConfig) -> None:
    """Rollout routing replay needs a rollout engine that records the experts, and single-turn
    episodes; errors name the keys."""
    if config.actor.router_replay == "off":
        return
    engine = config.rollout.engine.name
    if engine not in ROUTING_RECORDERS:
        raise ValueError(
            f"actor.router_replay={config.actor.router_replay} replays the experts the rollout recorded, and "
            f"rollout.engine.name={engine} does not return them yet: use one of {list(ROUTING_RECORDERS)} "
            "or actor.router_replay=off"
        )
    if config.agent.enabled:
        raise ValueError(
            f"actor.router_replay={config.actor.router_replay}: agent episodes (agent.name) do not carry "
            "the rollout's experts through their tool turns yet; set actor.router_replay=off"
        )


def check_preference(config: TrainConfig) -> None:
    """Online DPO's constraints, named by key."""
    if not config.prefers:
        return
    objective = "actor.objective=preference"
    if config.rollout.n < 2:
        raise ValueError(f"{objective} ranks each prompt's responses, so rollout.n must be at least 2")
    if config.mini_batch_prompts != config.data.train_batch_size:
        raise ValueError(
            f"{objective} takes one optimizer step per step; leave actor.ppo_mini_batch_size unset"
        )
    if config.algorithm.filter_groups.enable or config.algorithm.needs_greedy_baseline:
        raise ValueError(
            f"{objective} pairs responses itself: algorithm.filter_groups and the {config.algorithm.adv_estimator} "
            "baseline do not apply"
        )
    if config.algorithm.kl.use_kl_loss or config.algorithm.kl.use_kl_in_reward:
        raise ValueError(
            f"{objective}: the preference loss already measures the policy against the reference; "
            "turn algorithm.kl.use_kl_loss and use_kl_in_reward off"
        )
    check_online_preference_loss(config.actor.preference, objective)


def check_online_preference_loss(preference: PreferenceLossConfig, objective: str) -> None:
    """What online DPO's pairs cannot take: unpaired losses (they need labelled single responses),
    and LD-DPO's and WPO's per-token weighting (its reference log-probs are plain sums)."""
    names = preference.names or (preference.name,)
    unpaired = [name for name in names if name in UNPAIRED_LOSSES]
    if unpaired:
        raise ValueError(
            f"{objective} pairs each prompt's best and worst responses; actor.preference {unpaired[0]!r} is an "
            "unpaired loss (tandem dpo trains it on labelled data)"
        )
    if preference.ld_alpha is not None or preference.use_weighting:
        key = "ld_alpha" if preference.ld_alpha is not None else "use_weighting"
        raise ValueError(
            f"{objective}: actor.preference.{key} weighs tokens, and online DPO scores its reference as plain "
            "sums; leave it unset (tandem dpo has it)"
        )
