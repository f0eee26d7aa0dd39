"""A lean forward pass for Llama-style decoders (Llama, Qwen2, Qwen3) inside the native engine.

HF's modelling code makes ~100 small operator and module calls per layer; at small batch
a decode step is bound by that Python overhead, not by FLOPs. :class:`LeanDecoder` runs the
same computation — embedding, RMSNorm in fp32, q/k/v projections (Qwen3's q/k norms),
HF's own rotary embedding module, tandem's cached attention, o-projection, SwiGLU MLP,
residuals — as plain functional calls on the model's *own* parameters (nothing is copied,
so weight updates by name apply as before). Every operation mirrors HF's in order and
dtype, so the output equals HF's forward bit for bit (tested per family; with weights
prepacked by :class:`~tandem.kernels.cpu.linear.PackedLinears` only the matmuls' summation
order differs); models outside what it covers (other families, sliding-window attention,
non-SiLU MLPs) keep HF's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.cpu.linear import CPULinear, PackedLinears
from tandem.rollout.kv_cache import StepPlan, cached_attention, decode_step_attention

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
    """HF's RMSNorm: normalise in fp32, cast back, then scale. For fp32 tensors PyTorch's own
    ``rms_norm`` computes exactly this (bit for bit; tested) as one operator instead of seven."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin``, as ``x * cos + swap_halves(x) * signed_sin``.

    ``rotate_half(x) = cat(-x2, x1)``; with ``signed_sin = cat(-sin1, sin2)`` every product is
    the same up to where its sign sits, which is exact in floating point. Shapes:
    ``x [T, heads, d]``, ``cos, signed_sin [T, 1, d]``.
    """
    return (x * cos) + (x.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * signed_sin)


class RotaryTable:
    """``(cos, signed_sin)`` of HF's rotary embedding per position, gathered instead of recomputed.

    The table is HF's own rotary module applied to positions ``0..n-1`` (each entry is one
    elementwise computation, so a table row equals the per-step value bit for bit; tested);
    it grows on demand. Rotary types whose frequencies depend on the sequence length seen
    (``dynamic``, ``longrope``) call the module every step instead.
    """

    def __init__(self, rotary: torch.nn.Module) -> None:
        self.rotary = rotary
        rope_type = getattr(rotary, "rope_type", "default")
        self.cacheable = isinstance(rope_type, str) and "dynamic" not in rope_type and rope_type != "longrope"
        self._cos = self._signed_sin = None

    def __call__(
        self, position_ids: torch.Tensor, like: torch.Tensor, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids [T]``, ``like`` (dtype and device of the hidden states) -> two ``[T, 1, d]``.

        ``max_position``: a bound on the positions known to the caller, so that none is read
        back from the device (a CUDA graph cannot wait for one).
        """
        if not self.cacheable:
            return self._compute(position_ids, like)
        needed = (int(position_ids.max()) if max_position is None else max_position) + 1
        if self._cos is None or needed > self._cos.shape[0] or self._cos.dtype != like.dtype:
            size = max(needed, 256, 2 * (0 if self._cos is None else self._cos.shape[0]))
            self._cos, self._signed_sin = self._compute(torch.arange(size, device=like.device), like)
        return self._cos.index_select(0, position_ids), self._signed_sin.index_select(0, position_ids)

    def _compute(self, position_ids: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(like[:1].unsqueeze(0), position_ids.unsqueeze(0))  # [1, T, d]
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos[0].unsqueeze(1), signed_sin[0].unsqueeze(1)


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
        self.rotary = RotaryTable(self.decoder.rotary_emb)

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

    def _attention_inputs(
        self, index: int, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``index``'s rotated ``q [T, H, d]``, ``k [T, H_kv, d]`` and ``v [T, H_kv, d]`` from ``x [T, hidden]``.

        From one fused product, q and k sit side by side and are rotated together (one set of
        elementwise operators instead of two); Qwen3's per-head norms come first otherwise.
        """
        attention, group = self.decoder.layers[index].self_attn, self.qkv[index]
        tokens, dim = x.shape[0], attention.head_dim
        fused = None if self.qk_norm else self.packed.forward_group(group, x)
        if fused is not None:
            qk_width = group[0].out_features + group[1].out_features
            qk = _rotate(fused[:, :qk_width].view(tokens, -1, dim), cos, signed_sin)
            heads = group[0].out_features // dim
            return qk[:, :heads], qk[:, heads:], fused[:, qk_width:].view(tokens, -1, dim)
        q, k, v = (t.reshape(tokens, -1, dim) for t in self._linears(group, x))
        if self.qk_norm:
            q, k = _rms_norm(q, attention.q_norm), _rms_norm(k, attention.k_norm)
        return _rotate(q, cos, signed_sin), _rotate(k, cos, signed_sin), v

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        plan: StepPlan,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """``max_position``: a bound on ``position_ids`` (see :class:`RotaryTable`)."""
        decoder = self.decoder
        hidden = F.embedding(input_ids, decoder.embed_tokens.weight)
        cos, signed_sin = self.rotary(position_ids, hidden, max_position)  # [T, 1, head_dim]
        tokens = input_ids.shape[0]
        for index, layer in enumerate(decoder.layers):
            attention, mlp = layer.self_attn, layer.mlp
            x = _rms_norm(hidden, layer.input_layernorm)
            q, k, v = self._attention_inputs(index, x, cos, signed_sin)
            if plan.prefill:
                attended, _ = cached_attention(
                    attention,
                    q.transpose(0, 1).unsqueeze(0),
                    k.transpose(0, 1).unsqueeze(0),
                    v.transpose(0, 1).unsqueeze(0),
                    None,
                    scaling=attention.scaling,
                    tandem_plan=plan,
                )
            else:  # a decode-only step: no packed layout to rebuild
                attended = decode_step_attention(plan, attention.layer_idx, q, k, v, attention.scaling)
            hidden = hidden + self._linear(attention.o_proj, attended.reshape(tokens, -1))
            x = _rms_norm(hidden, layer.post_attention_layernorm)
            gate, up = self._linears(self.gate_up[index], x)
            hidden = hidden + self._linear(mlp.down_proj, F.silu(gate) * up)
        return _rms_norm(hidden, decoder.norm)
