"""``DPOConfig``: ``tandem dpo``'s settings — data, engine, loss, reference and loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.algos.preference import PreferenceLossConfig
from tandem.config.paths import INPUT_PATH, MODEL_PATH, OUTPUT_PATH, path_field
from tandem.dpo.data import PreferenceDataConfig
from tandem.engine.config import EngineConfig, check_trainer_parallel_dims
from tandem.run.dataplane import TrainerDataPlaneConfig, check_dataplane
from tandem.sft.config import SFTTrainerConfig

REFERENCES = ("precompute", "model")


@dataclass(frozen=True)
class DPOTrainerConfig(SFTTrainerConfig):
    """The loop (``trainer.*``): the SFT loop's settings (``global_batch_size`` counts pairs),
    under another directory and name."""

    output_dir: str = path_field(OUTPUT_PATH, "outputs/dpo")
    experiment: str = "dpo"


@dataclass(frozen=True)
class DPOConfig:
    """Everything ``tandem dpo`` reads.

    Attributes:
        model_path: the policy to start from (fills ``engine.model_path`` when that is empty).
        data: the preference pairs (:class:`PreferenceDataConfig`).
        engine: the training engine; packing keeps each pair in one micro-batch and scores its
            prompt once for both responses.
        preference: the preference loss (:class:`PreferenceLossConfig`: ``name``, ``beta``,
            ``label_smoothing``, ``gamma``, ``rpo_alpha``).
        reference: ``precompute`` (score every pair under the starting model once, before
            training; kept in ``<output_dir>/reference_logps.pt`` for resume) or ``model`` (a
            frozen reference scores each step's pairs). With LoRA the reference is the base model
            (the adapter switched off), in both cases without a second copy.
        ref_model_path: the reference model when it is not the starting policy (empty: ``model_path``).
        trainer: the loop (:class:`DPOTrainerConfig`).
        dataplane: whether each step's pairs reach the workers as references, the reference's
            scores kept with them (docs/data-plane.md).
        plugins: user files imported before the rest validates (:mod:`tandem.config.plugins`).
    """

    model_path: str = path_field(MODEL_PATH)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(lr=1e-6))
    preference: PreferenceLossConfig = field(default_factory=PreferenceLossConfig)
    reference: str = "precompute"
    ref_model_path: str = path_field(MODEL_PATH)
    trainer: DPOTrainerConfig = field(default_factory=DPOTrainerConfig)
    dataplane: TrainerDataPlaneConfig = field(default_factory=TrainerDataPlaneConfig)
    plugins: tuple[str, ...] = path_field(INPUT_PATH, ())

    def __post_init__(self) -> None:
        if not (self.model_path or self.engine.model_path):
            raise ValueError("model_path is required (a local HF model directory)")
        if not self.data.train_path:
            raise ValueError("data.train_path is required (a .parquet or .jsonl file of preference pairs)")
        check_trainer_parallel_dims("engine", self.engine, self.trainer.world_size)
        check_dataplane(self.dataplane, self.trainer.backend)
        if self.reference not in REFERENCES:
            raise ValueError(f"reference={self.reference!r} is not allowed; choose one of {list(REFERENCES)}")
        if self.ref_model_path and self.engine.lora.rank:
            raise ValueError(
                "ref_model_path is set, but with LoRA the reference is the base model; leave it empty"
            )
