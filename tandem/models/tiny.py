"""Tiny decoder-only models (Llama, Qwen2, Qwen3 and the Qwen2-MoE / Qwen3-MoE mixture-of-experts
families) built from a config, for tests and the demo."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tandem.config.validation import check_choice, check_positive
from tandem.models.tokenizer import build_char_tokenizer

FAMILIES = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "qwen2_moe": Qwen2MoeConfig,
    "qwen3_moe": Qwen3MoeConfig,
}
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class TinyModelConfig:
    """Size of a tiny model; the defaults give about 0.4M parameters with the character tokenizer.

    ``hidden_size=256, num_layers=4, intermediate_size=768`` gives about 3M (the benchmark size).

    The MoE families (``qwen2_moe``, ``qwen3_moe``) replace every layer's MLP with ``num_experts``
    experts of ``moe_intermediate_size``, ``num_experts_per_tok`` of them per token; Qwen2-MoE adds
    its sigmoid-gated shared expert of ``shared_expert_intermediate_size``. ``norm_topk_prob``
    renormalises the top-k routing weights to sum to 1 (Qwen3-MoE checkpoints set it, Qwen2-MoE's
    do not). Dense families ignore these fields.
    """

    family: str = "qwen2"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 128
    norm_topk_prob: bool | None = None
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
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
        ):
            check_positive("tiny_model", name, getattr(self, name))
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"tiny_model.num_experts_per_tok={self.num_experts_per_tok} must not exceed "
                f"num_experts={self.num_experts}"
            )
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
        **_moe_settings(config),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def _moe_settings(config: TinyModelConfig) -> dict:
    """The HF config keywords of ``config``'s experts (none for a dense family)."""
    if config.family not in MOE_FAMILIES:
        return {}
    settings = {
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob
        if config.norm_topk_prob is not None
        else config.family == "qwen3_moe",
    }
    if config.family == "qwen2_moe":
        settings["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    return settings


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
