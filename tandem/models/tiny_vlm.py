"""Tiny vision-language models (the Qwen2-VL and Qwen2.5-VL families) built from a config, with
their image processor and tokenizer saved beside them, for tests and the VLM demo.

The directory :func:`save_tiny_vlm` writes is an ordinary HF model directory: ``config.json``
and the weights, the character tokenizer with Qwen2-VL's vision markers
(:func:`tandem.models.tokenizer.build_char_tokenizer`), and ``preprocessor_config.json`` for
``AutoImageProcessor``. Nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

from tandem.config.validation import check_choice, check_positive
from tandem.models.tokenizer import build_char_tokenizer

VLM_FAMILIES = {
    "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
}
PATCH_SIZE = 14  # pixels per patch side: a merged 2x2 block of patches is one 28-pixel token
MERGE_SIZE = 2


@dataclass(frozen=True)
class TinyVLMConfig:
    """Size of a tiny VLM: a language model like :class:`~tandem.models.tiny.TinyModelConfig`'s
    and a vision tower of ``vision_depth`` blocks of width ``vision_width``.

    ``min_pixels`` / ``max_pixels`` bound the image processor's resizing (Qwen2-VL's own
    settings): an image is scaled so its area lies between them, in 28-pixel steps, and each
    28x28 block becomes one ``<|image_pad|>`` token (112x112 pixels: 16 tokens).
    """

    family: str = "qwen2_vl"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    vision_depth: int = 2
    vision_width: int = 64
    vision_heads: int = 4
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("tiny_vlm", "family", self.family, VLM_FAMILIES)
        for name in (
            "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
            "vision_depth", "vision_width", "vision_heads", "min_pixels", "max_pixels",
        ):  # fmt: skip
            check_positive("tiny_vlm", name, getattr(self, name))
        head_dim = self.hidden_size // self.num_heads
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads or head_dim % 4:
            raise ValueError(
                f"tiny_vlm: hidden_size={self.hidden_size} must divide by num_heads={self.num_heads} into a "
                f"head size divisible by 4 (M-RoPE splits it three ways), and num_heads by "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.vision_width % self.vision_heads:
            raise ValueError(
                f"tiny_vlm: vision_width={self.vision_width} must divide by vision_heads={self.vision_heads}"
            )
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"tiny_vlm: min_pixels={self.min_pixels} must not exceed max_pixels={self.max_pixels}"
            )


def mrope_section(head_dim: int) -> list[int]:
    """M-RoPE's split of the ``head_dim / 2`` rotary frequencies over (time, height, width), in
    Qwen2-VL's proportions (16, 24, 24 of 64)."""
    half = head_dim // 2
    height = width = (half * 3) // 8
    return [half - height - width, height, width]


def build_tiny_vlm(config: TinyVLMConfig, tokenizer) -> PreTrainedModel:
    """A randomly initialised VLM of ``config``'s family and size for ``tokenizer`` (which has
    the vision markers), deterministic in ``config.seed``."""
    config_class, model_class = VLM_FAMILIES[config.family]
    head_dim = config.hidden_size // config.num_heads
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": mrope_section(head_dim),
        },
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    vision = dict(
        depth=config.vision_depth,
        num_heads=config.vision_heads,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=2,
        in_channels=3,
    )
    if config.family == "qwen2_vl":
        vision.update(embed_dim=config.vision_width, hidden_size=config.hidden_size, mlp_ratio=2)
    else:  # Qwen2.5-VL: windowed attention except in the listed blocks, an RMSNorm/SwiGLU tower
        vision.update(
            hidden_size=config.vision_width,
            out_hidden_size=config.hidden_size,
            intermediate_size=2 * config.vision_width,
            window_size=56,
            fullatt_block_indexes=[config.vision_depth - 1],
        )
    markers = {name: tokenizer.convert_tokens_to_ids(token) for name, token in VISION_MARKER_NAMES.items()}
    hf_config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=False, **markers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return model_class(hf_config).to(torch.float32)


VISION_MARKER_NAMES = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


def build_image_processor(min_pixels: int, max_pixels: int):
    """Qwen2-VL's image processor (the Pillow implementation, which needs no torchvision)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as processor_class,
        )
    except ImportError:  # transformers before 5 has one (Pillow-based) class
        from transformers import Qwen2VLImageProcessor as processor_class
    return processor_class(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=2,
    )


def save_tiny_vlm(path: str | Path, config: TinyVLMConfig | None = None) -> Path:
    """Write a tiny VLM, its tokenizer and its image processor to ``path``."""
    config = config or TinyVLMConfig()
    path = Path(path)
    tokenizer = build_char_tokenizer(vision=True)
    model = build_tiny_vlm(config, tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    build_image_processor(config.min_pixels, config.max_pixels).save_pretrained(path)
    return path
