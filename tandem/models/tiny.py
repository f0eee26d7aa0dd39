"""Tiny decoder-only models (Llama, Qwen2, Qwen3 families) built from a config, for tests and the demo."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, PreTrainedModel, Qwen2Config, Qwen3Config

from tandem.config.validation import check_choice, check_positive
from tandem.models.tokenizer import build_char_tokenizer

FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


@dataclass(frozen=True)
class TinyModelConfig:
    """Size of a tiny model; the defaults give about 0.4M parameters with the character tokenizer.

    ``hidden_size=256, num_layers=4, intermediate_size=768`` gives about 3M (the benchmark size).
    """

    family: str = "qwen2"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("tiny_model", "family", self.family, FAMILIES)
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            check_positive("tiny_model", name, getattr(self, name))
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"tiny_model: hidden_size={self.hidden_size} must divide by num_heads={self.num_heads}, "
                f"which must divide by num_kv_heads={self.num_kv_heads}"
            )


def build_tiny_model(
    config: TinyModelConfig, vocab_size: int, pad_token_id: int, bos_token_id: int, eos_token_id: int
) -> PreTrainedModel:
    """A randomly initialised causal LM of ``config``'s family and size (deterministic in ``config.seed``)."""
    from transformers import AutoModelForCausalLM

    hf_config = FAMILIES[config.family](
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        head_dim=config.hidden_size // config.num_heads,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def save_tiny_model(path: str | Path, config: TinyModelConfig | None = None) -> Path:
    """Write a tiny model and the character tokenizer to ``path`` (a normal HF model directory)."""
    path = Path(path)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(
        config or TinyModelConfig(),
        len(tokenizer),
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
