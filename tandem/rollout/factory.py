"""``build_rollout_engine``: the one place a rollout engine is built from its config."""

from __future__ import annotations

from tandem.rollout.base import RolloutEngine
from tandem.rollout.config import RolloutEngineConfig


def build_rollout_engine(config: RolloutEngineConfig, model_path: str) -> RolloutEngine:
    """The engine ``config.name`` names, over the HF model directory ``model_path`` and its tokenizer.

    Engines import lazily, so a missing optional install (vLLM) only matters when it is chosen.
    """
    if config.name == "native":
        from tandem.rollout.native import NativeRolloutEngine

        return NativeRolloutEngine.from_pretrained(model_path, config.native)
    if config.name == "vllm":
        from tandem.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(model_path, config.vllm)
    if config.name == "hf":
        from tandem.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine.from_pretrained(model_path, config.hf.dtype, config.hf.device)
    raise ValueError(f"rollout.engine.name={config.name!r} has no builder")  # the config validated it
