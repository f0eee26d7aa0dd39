"""``RewardModelConfig``: ``tandem rm``'s settings — preference pairs, a reward head, the loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.algos.preference import PreferenceLossConfig
from tandem.config.paths import OUTPUT_PATH, path_field
from tandem.dpo.config import DPOConfig, DPOTrainerConfig
from tandem.engine.config import EngineConfig


@dataclass(frozen=True)
class RewardModelTrainerConfig(DPOTrainerConfig):
    """The loop (``trainer.*``): :class:`DPOTrainerConfig`'s, under another directory and name."""

    output_dir: str = path_field(OUTPUT_PATH, "outputs/rm")
    experiment: str = "rm"


@dataclass(frozen=True)
class RewardModelConfig(DPOConfig):
    """Everything ``tandem rm`` reads: the fields of :class:`DPOConfig`, with a reward head and
    the Bradley–Terry loss.

    Attributes:
        engine: the training engine with ``head=reward``: the model's decoder and a one-output
            ``score`` head (fresh when ``model_path`` is a causal LM), read at each response's
            last token; exported as an HF ``...ForSequenceClassification`` model.
        preference: a reference-free pair loss on the two scores: ``bradley_terry`` (default:
            ``-log σ(β(r_c − r_r))``, label smoothing allowed).
    """

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(head="reward", lr=1e-5))
    preference: PreferenceLossConfig = field(
        default_factory=lambda: PreferenceLossConfig(name="bradley_terry", beta=1.0)
    )
    trainer: RewardModelTrainerConfig = field(default_factory=RewardModelTrainerConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.engine.head != "reward":
            raise ValueError(
                f"engine.head={self.engine.head!r}: tandem rm trains a reward head (engine.head=reward)"
            )
        if self.preference.needs_reference:
            raise ValueError(
                f"preference.name={self.preference.name!r} compares against a reference model; a reward model "
                "is trained with a reference-free loss (bradley_terry)"
            )
        if self.preference.rpo_alpha:
            raise ValueError(
                "preference.rpo_alpha needs token log-probs; a reward model has none (leave it 0)"
            )
        if self.engine.lora.rank:
            raise ValueError(
                "engine.lora.rank: tandem rm trains the full model (LoRA would leave the new head frozen)"
            )
        if self.ref_model_path:
            raise ValueError("ref_model_path: a reward model has no reference; leave it empty")
