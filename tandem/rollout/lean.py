"""A lean forward pass for Llama-style decoders (Llama, Qwen2, Qwen3) inside the native engine.

HF's modelling code makes ~100 small operator and module calls per layer; at small batch
a decode step is bound by that Python overhead, not by FLOPs. :class:`LeanDecoder` runs the
same computation — embedding, RMSNorm in fp32, q/k/v projections (Qwen3's q/k norms),
HF's own rotary embedding module, tandem's cached attention, o-projection, SwiGLU MLP,
residuals — as plain functional calls on the model's *own* parameters (nothing is copied,
so weight updates by name apply as before). Every operation mirrors HF's in order and
dtype, so the output equals HF's forward bit for bit (tested per family; with weights
prepacked by :class:`~tandem.models.cpu_linear.PackedLinears` only the matmuls' summation
order differs); models outside what it covers (other families, sliding-window attention,
non-SiLU MLPs) keep HF's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.models.cpu_linear import CPULinear, PackedLinears
from tandem.rollout.kv_cache import StepPlan, cached_attention

PLAIN_LINEARS = (torch.nn.Linear, CPULinear)

LEAN_FAMILIES = ("llama", "qwen2", "qwen3")


def lean_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why :class:`LeanDecoder` cannot run ``model`` (``None`` when it can)."""
    config = model.config
    if config.model_type not in LEAN_FAMILIES:
        return f"model type {config.model_type!r} (lean forward covers {list(LEAN_FAMILIES)})"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act={config.hidden_act!r}"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    layer_types = getattr(config, "layer_types", None)
    if layer_types and set(layer_types) != {"full_attention"}:
        return f"layer types {sorted(set(layer_types))}"
    decoder = model.get_decoder()
    for name in ("embed_tokens", "rotary_emb", "norm", "layers"):
        if not hasattr(decoder, name):
            return f"the decoder has no {name}"
    return None


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """HF's RMSNorm: normalise in fp32, cast back, then scale."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


class LeanDecoder:
    """``forward(input_ids [T], position_ids [T], plan) -> hidden [T, hidden]`` for one packed step."""

    def __init__(self, model: torch.nn.Module, packed: PackedLinears | None = None) -> None:
        reason = lean_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the lean forward does not support this model: {reason}")
        self.decoder = model.get_decoder()
        self.qk_norm = model.config.model_type == "qwen3"
        self.packed = packed if packed is not None else PackedLinears(model, enabled=False)
        # q/k/v and gate/up read the same input: one product each when their weights are packed.
        layers = self.decoder.layers
        self.qkv = [(a.q_proj, a.k_proj, a.v_proj) for a in (layer.self_attn for layer in layers)]
        self.gate_up = [(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in layers]
        self.packed.fuse(self.qkv + self.gate_up)

    def _linears(self, group: tuple[torch.nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor]:
        """Linear layers sharing the input ``x``: one fused product when packed, else one by one."""
        fused = self.packed.forward_fused(group, x)
        return fused if fused is not None else [self._linear(module, x) for module in group]

    def _linear(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A plain linear layer as a direct call (no module-call overhead; its prepacked weight
        when there is one); anything else (LoRA, ...) as itself."""
        if type(module) not in PLAIN_LINEARS:
            return module(x)
        return self.packed.forward(module, x)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        decoder = self.decoder
        hidden = F.embedding(input_ids, decoder.embed_tokens.weight)
        cos, sin = decoder.rotary_emb(hidden.unsqueeze(0), position_ids.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, head_dim]
        tokens = input_ids.shape[0]
        for index, layer in enumerate(decoder.layers):
            attention, mlp = layer.self_attn, layer.mlp
            x = _rms_norm(hidden, layer.input_layernorm)
            q, k, v = (t.reshape(tokens, -1, attention.head_dim) for t in self._linears(self.qkv[index], x))
            if self.qk_norm:
                q, k = _rms_norm(q, attention.q_norm), _rms_norm(k, attention.k_norm)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            attended, _ = cached_attention(
                attention,
                q.transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                None,
                scaling=attention.scaling,
                tandem_plan=plan,
            )
            hidden = hidden + self._linear(attention.o_proj, attended.reshape(tokens, -1))
            x = _rms_norm(hidden, layer.post_attention_layernorm)
            gate, up = self._linears(self.gate_up[index], x)
            hidden = hidden + self._linear(mlp.down_proj, F.silu(gate) * up)
        return _rms_norm(hidden, decoder.norm)
