"""LoRA adapters through PEFT, and the merged weights a rollout engine needs."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from tandem.engine.config import LoraConfig
from tandem.engine.vision_model import VISION_TOWER_MODULES
from tandem.models.vision import is_vision_language


def apply_lora(model: nn.Module, config: LoraConfig) -> nn.Module:
    """Wrap ``model`` with a LoRA adapter; only the adapter's parameters stay trainable. A
    vision-language model's adapters go on its language model only: the vision tower stays as
    loaded (frozen)."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as error:  # pragma: no cover - only without the extra
        raise ImportError("LoRA needs PEFT: pip install 'tandem-rl[peft]'") from error
    names = [name.strip() for name in config.target_modules.split(",") if name.strip()]
    targets = "all-linear" if names == ["all-linear"] else names
    peft_config = PeftLoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=targets,
        exclude_modules=VISION_TOWER_MODULES if is_vision_language(model) else None,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_config)


@torch.no_grad()
def iter_merged_lora_parameters(peft_model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, weight)`` of the base model with every LoRA delta merged in; adapter tensors
    are skipped. Under FSDP2 each weight and delta is gathered whole as it is reached, so every
    rank must iterate, in step."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    adapted = {
        f"{module_name}.base_layer.weight": module
        for module_name, module in base.named_modules()
        if isinstance(module, LoraLayer)
    }
    for name, param in base.named_parameters():
        if ".lora_" in name:
            continue
        tensor = _whole(param.detach())
        if name in adapted:
            layer = adapted[name]
            for adapter in layer.active_adapters:
                tensor = tensor + _delta_weight(layer, adapter).to(tensor.dtype)
        yield name.replace(".base_layer.", "."), tensor


def _delta_weight(layer: nn.Module, adapter: str) -> torch.Tensor:
    """A LoRA linear layer's ``B @ A * scaling`` (transposed for a ``fan_in_fan_out`` layer), as
    PEFT's ``get_delta_weight`` computes it, of the whole adapter matrices: under tensor
    parallelism one of them is split and the other not, which a DTensor product refuses to mix."""
    weight_a = _whole(layer.lora_A[adapter].weight.detach())
    weight_b = _whole(layer.lora_B[adapter].weight.detach())
    dtype = weight_b.dtype
    if weight_b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):  # as PEFT: fp32 on the CPU
        weight_a, weight_b = weight_a.float(), weight_b.float()
    delta = weight_b @ weight_a
    return ((delta.T if layer.fan_in_fan_out else delta) * layer.scaling[adapter]).to(dtype)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or the full tensor of an FSDP2 shard (a collective)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
