"""The training engine's model, made ready on this rank before data parallelism wraps it.

:func:`prepare_model` applies, in this order: the device and parameter dtype, gradient
checkpointing, a vision-language model's frozen vision tower, the attention implementation
(Ulysses between all-to-alls, or varlen attention within packed sequences), LoRA, the
tensor-parallel split (its adapters split as their base layers; before FSDP2, which shards
each rank's tensor-parallel shards over ``dp x sp``) and the expert-parallel shards.
:func:`head_module` puts the head on top that turns hidden states into what a step trains on
(log-probs, values or scores).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from tandem.engine.config import EngineConfig
from tandem.engine.expert_parallel import apply_expert_parallel
from tandem.engine.lora import apply_lora
from tandem.engine.mesh import EngineMesh
from tandem.engine.reward_model import TokenScoreModel
from tandem.engine.tensor_parallel import apply_tensor_parallel, check_tensor_parallel_fits
from tandem.engine.token_model import TokenLogProbModel
from tandem.engine.ulysses_attention import ULYSSES_ATTENTION, check_heads
from tandem.engine.value_model import TokenValueModel
from tandem.engine.varlen_attention import VARLEN_ATTENTION
from tandem.engine.vision_model import freeze_vision_tower
from tandem.models.loading import resolve_dtype


def prepare_model(
    model: nn.Module, config: EngineConfig, mesh: EngineMesh, device: torch.device, vision_language: bool
) -> tuple[nn.Module, set[nn.Parameter]]:
    """``model`` (an HF model on the CPU) ready to train on this rank of ``mesh`` (module
    docstring); returns it (PEFT's wrapper with LoRA) and its expert-parallel shards, which DDP
    and FSDP2 must leave alone (they are reduced by their own group)."""
    # FSDP2 moves each unit's parameters to the device as it shards them, so the whole model
    # never sits on one GPU; the other strategies hold it whole there anyway
    target = None if config.strategy == "fsdp2" else device
    model = model.to(device=target, dtype=resolve_dtype(config.param_dtype))
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if vision_language and config.freeze_vision_tower:
        freeze_vision_tower(model)
    if config.tp_size > 1:  # whole heads on each tensor-parallel rank, before sp splits its share
        check_tensor_parallel_fits(model, config.tp_size)
    if config.sp_size > 1:
        text = model.config.get_text_config()  # a VLM's language model (its vision tower is not split)
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        check_heads(heads, kv_heads, config.sp_size, config.tp_size)
        # the varlen attention between all-to-alls
        model.set_attn_implementation(
            {"text_config": ULYSSES_ATTENTION} if vision_language else ULYSSES_ATTENTION
        )
    elif config.use_packing:  # attention within each packed sequence only (cost sum(len^2), not T^2)
        # a VLM's vision tower keeps its own (bidirectional, per image) attention
        model.set_attn_implementation(
            {"text_config": VARLEN_ATTENTION} if vision_language else VARLEN_ATTENTION
        )
    if config.lora.rank:
        model = apply_lora(model, config.lora)
    if config.tp_size > 1:  # before FSDP2, which shards each rank's tensor-parallel shards over dp x sp
        apply_tensor_parallel(model, mesh.tp_mesh)
    expert_shards: set[nn.Parameter] = set()
    if config.ep_size > 1:  # on the mesh's (edp, ep) view, which build_engine_mesh made
        scale = 1 / mesh.gradient_ranks  # undoes the loss scaling DDP / FSDP2 average away
        expert_shards = apply_expert_parallel(model, mesh, device, scale)
    return model, expert_shards


def head_module(
    model: nn.Module, config: EngineConfig, vocab_group: ProcessGroup | None
) -> TokenLogProbModel | TokenValueModel | TokenScoreModel:
    """``model`` under the head ``config.head`` names: log-probs (``lm``, its vocabulary split over
    ``vocab_group`` under tensor parallelism), a critic's values or a reward model's scores."""
    if config.head == "value":
        return TokenValueModel(model)
    if config.head == "reward":
        return TokenScoreModel(model)
    return TokenLogProbModel(
        model,
        config.logprob_chunk_size,
        config.logprob_temperature,
        config.logprob_head_dtype,
        vocab_group=vocab_group,
    )
