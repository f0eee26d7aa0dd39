"""``actor.*``: the policy's objective, loss, engine and offloading."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.algos import (
    PolicyLossConfig,
)
from tandem.algos.preference import PreferenceLossConfig
from tandem.config.validation import check_choice, check_positive, check_range
from tandem.engine.config import ROUTER_REPLAY, EngineConfig
from tandem.engine.offload import OffloadConfig

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
