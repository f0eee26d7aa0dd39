"""What the engine does differently for a vision-language model (Qwen2-VL, Qwen2.5-VL): what it
refuses, how it freezes the vision tower, which blocks FSDP2 shards, what an export copies.

The vision tower is the inner model's ``visual`` (its patch embedding, blocks and the merger
that projects into the language model's width). It trains with the language model unless
``engine.freeze_vision_tower`` is set. Under LoRA the adapters go on the language model's
linear layers only and every base weight is frozen, the vision tower's included, whatever
``freeze_vision_tower`` says.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from torch import nn
from transformers import AutoConfig

from tandem.engine.config import EngineConfig
from tandem.models.vision import is_vision_language, vision_language_model

# the image processor's and the multimodal processor's files beside the weights and tokenizer
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
)
# PEFT's ``exclude_modules`` regex (matched against full module names): the vision tower's modules
VISION_TOWER_MODULES = r".*\bvisual\b.*"


def engine_model_is_vision_language(config: EngineConfig, model: nn.Module | None) -> bool:
    """Whether the engine trains a vision-language model: the given ``model``'s config, else the
    one saved at ``config.model_path`` (read before loading, so a refusal comes first)."""
    if model is not None:
        return is_vision_language(model)
    if not (Path(config.model_path) / "config.json").exists():
        return False  # no model there: loading it says so
    return is_vision_language(AutoConfig.from_pretrained(config.model_path))


def check_vision_language_engine(config: EngineConfig, owner: str = "engine") -> None:
    """Refuse, naming the keys, what a vision-language model does not combine with yet."""
    refused = {
        "tp_size": (
            config.tp_size > 1,
            "tensor parallelism does not split the vision tower yet; set tp_size=1",
        ),
        "head": (
            config.head != "lm",
            "value and reward heads read no images yet; a vision-language model trains as a policy (head=lm)",
        ),
    }
    for key, (applies, why) in refused.items():
        if applies:
            raise ValueError(
                f"{owner}.{key}={getattr(config, key)!r} with a vision-language model ({config.model_path or 'given'}): "
                f"{why}"
            )


def freeze_vision_tower(model: nn.Module) -> None:
    """The vision tower's parameters (patch embedding, blocks, merger) stop requiring gradients,
    which leaves them out of the optimizer and out of data-parallel gradient reduction."""
    vision_language_model(model).visual.requires_grad_(False)


def vision_blocks(module: nn.Module) -> list[nn.Module]:
    """The vision tower's repeated blocks (a ``ModuleList`` named ``visual.blocks``), found by
    name; none in a text model."""
    blocks = []
    for name, child in module.named_modules():
        if (name == "visual.blocks" or name.endswith(".visual.blocks")) and isinstance(child, nn.ModuleList):
            blocks.extend(child)
    return blocks


def copy_processor_files(source: str | Path, target: str | Path) -> list[str]:
    """Copy the processor files of the model directory ``source`` (:data:`PROCESSOR_FILES`, those
    present) into ``target``, so an exported vision-language model loads its image processor;
    returns the names copied."""
    copied = []
    for name in PROCESSOR_FILES:
        if (Path(source) / name).exists():
            shutil.copyfile(Path(source) / name, Path(target) / name)
            copied.append(name)
    return copied
