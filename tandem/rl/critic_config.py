"""``CriticConfig``: PPO's value model (``critic.*``), trained when the advantage estimator reads values."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.algos import LOSS_AGG_MODES
from tandem.config.paths import MODEL_PATH, path_field
from tandem.config.validation import check_choice, check_positive, check_range
from tandem.engine.config import EngineConfig
from tandem.engine.offload import OffloadConfig

PLACEMENTS = ("separate", "colocated")


@dataclass(frozen=True)
class CriticConfig:
    """The critic (``critic.*``): runs only when ``algorithm.adv_estimator`` reads a critic's
    values (``gae``), with the actor's worker count, in processes of its own or the actor's.

    Attributes:
        model_path: the critic's HF directory (empty: the policy's ``model_path``). A causal LM
            directory works: its decoder is kept and a one-output ``score`` head is added
            (freshly initialised, as transformers' ``...ForTokenClassification`` does).
        engine: its training engine (``critic.engine.lr``, token budget, strategy, ...). Its
            ``model_path``, ``device``, ``seed`` and ``head`` follow the run (see
            :mod:`tandem.rl.derived`); ``total_steps`` 0 means the critic's optimizer steps.
        ppo_epochs: passes over each step's batch (0: ``actor.ppo_epochs``).
        ppo_mini_batch_size: prompts per critic optimizer step (0: the actor's).
        cliprange_value: the value clip ``c`` of the clipped value loss (None: unclipped).
        loss_agg_mode: how the value loss is aggregated (empty: the actor's ``loss_agg_mode``).
        warmup_steps: the first steps train only the critic; the actor waits (verl's
            ``trainer.critic_warmup=k`` is ``k - 1`` of them: verl's actor starts at step ``k``).
        placement: ``separate`` (a worker group of its own: its own processes, and with Ray
            GPUs of its own) or ``colocated`` (inside the actor's processes, one per rank, on
            the actor's device and process group: no second set of processes or GPUs).
        offload: what of the critic waits on the CPU except while it computes values or updates
            (``critic.offload.params``, ``critic.offload.optimizer``; verl's
            ``critic.model.fsdp_config.param_offload`` / ``optimizer_offload``). On the CPU, and
            for the results, it changes nothing.
    """

    model_path: str = path_field(MODEL_PATH)
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(lr=1e-5))
    ppo_epochs: int = 0
    ppo_mini_batch_size: int = 0
    cliprange_value: float | None = 0.5
    loss_agg_mode: str = ""
    warmup_steps: int = 0
    placement: str = "separate"
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    def __post_init__(self) -> None:
        check_range("critic", "ppo_epochs", self.ppo_epochs, low=0)
        check_range("critic", "ppo_mini_batch_size", self.ppo_mini_batch_size, low=0)
        check_range("critic", "warmup_steps", self.warmup_steps, low=0)
        check_choice("critic", "placement", self.placement, PLACEMENTS)
        if self.cliprange_value is not None:
            check_positive("critic", "cliprange_value", self.cliprange_value)
        if self.loss_agg_mode:
            check_choice("critic", "loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        if self.engine.lora.rank:
            raise ValueError(
                "critic.engine.lora.rank: the critic trains all its weights (LoRA is for the actor)"
            )
