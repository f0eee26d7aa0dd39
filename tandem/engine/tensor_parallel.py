"""Tensor parallelism for Llama / Qwen2 / Qwen3 decoders, dense or MoE: DTensor plans over the ``tp`` mesh dimension.

Each decoder layer (Megatron-LM's split, as torchtitan applies it):

* attention: ``q_proj``, ``k_proj``, ``v_proj`` column-wise (each rank projects
  ``H / P`` query heads and ``H_kv / P`` key/value heads), ``o_proj`` row-wise (the partial
  outputs are summed over the group). The attention functions read the head count from the
  projected tensor (``[B, heads, T, D]``, HF reshapes with ``-1``), so they run unchanged on a
  rank's heads;
* MLP: ``gate_proj`` and ``up_proj`` column-wise, ``down_proj`` row-wise. A mixture-of-experts
  block (Qwen2-MoE / Qwen3-MoE) is not split: it runs whole on every rank, on the whole hidden
  states, like a norm (its router, experts and shared expert replicated, their gradients the
  same on every rank), its experts split by expert parallelism if ``ep_size > 1``
  (:mod:`tandem.engine.expert_parallel`).

The token embedding is split over the vocabulary (row-wise: each rank looks up the ids it
holds, zeros elsewhere, summed over the group), and the output head's rows likewise; the head
is never called as a module (the fp32 log-prob head reads its weight), so its shard goes to
:func:`~tandem.engine.vocab_parallel.vocab_parallel_log_probs_from_hidden`. A tied head is the
embedding's weight, already split. Norms, rotary embeddings and the residual stream stay
replicated: every rank holds the whole hidden state between layers, and the replicated
parameters' gradients come out the same on every rank. Qwen3's per-head query and key norms
run on a rank's heads; their weights' gradients are summed over the group.

LoRA adapters follow their base layer's split (:func:`module_plan`), so LoRA trains under tensor
parallelism exactly as it does whole.

Applied before FSDP2 (torchtitan's order): FSDP2 then shards each rank's tensor-parallel
shards over the flattened ``dp x sp`` dimension (:mod:`tandem.engine.mesh`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from tandem.engine.expert_parallel import sparse_blocks
from tandem.engine.parallel import decoder_layers

HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")  # Qwen3's per-head norms, on a rank's heads
ATTENTION_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
}
MLP_PLAN = {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
LAYER_PLAN = ATTENTION_PLAN | MLP_PLAN  # a dense decoder layer's


def check_tensor_parallel_fits(model: nn.Module, tp_size: int, owner: str = "engine") -> None:
    """Raise ``ValueError`` naming ``<owner>.tp_size`` unless ``model``'s heads split over
    ``tp_size`` ranks and every decoder layer has the linear layers of :data:`LAYER_PLAN`."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp_size or kv_heads % tp_size:
        raise ValueError(
            f"{owner}.tp_size={tp_size} must divide the model's num_attention_heads={heads} and "
            f"num_key_value_heads={kv_heads}: each tensor-parallel rank projects whole heads"
        )
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{owner}.tp_size={tp_size}: found no decoder layers (a ModuleList named 'layers')")
    for layer in layers:
        for name in layer_plan(layer):
            if not isinstance(_submodule(layer, name), nn.Linear):
                raise ValueError(
                    f"{owner}.tp_size={tp_size}: the model's decoder layers have no linear {name} (tensor "
                    "parallelism plans Llama / Qwen2 / Qwen3 layers and Qwen2-MoE / Qwen3-MoE attention)"
                )


def layer_plan(layer: nn.Module) -> dict[str, str]:
    """The split of one decoder layer: attention always; its MLP unless it is a mixture-of-experts
    block, which stays whole on every rank (its experts split by expert parallelism, if at all)."""
    return ATTENTION_PLAN if sparse_blocks(layer) else LAYER_PLAN


def _split_over_heads(norm: nn.Module, tp_mesh: DeviceMesh) -> None:
    """A per-head norm (Qwen3's ``q_norm`` / ``k_norm``: ``[B, T, heads, D]`` -> same) on this
    rank's heads: its weight ``[D]`` becomes a replicated DTensor and its input is marked as
    split over the heads, so the weight's gradient, each rank's from its own heads, is summed
    over the group (without it each rank would keep a partial gradient)."""

    def heads_split(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        hidden = inputs[0]
        return (DTensor.from_local(hidden, mesh, [Shard(hidden.dim() - 2)], run_check=False), *inputs[1:])

    def local(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local()

    distribute_module(norm, tp_mesh, input_fn=heads_split, output_fn=local)


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def module_plan(module: nn.Module, name: str, style: str) -> dict[str, ParallelStyle]:
    """The DTensor styles of the linear layer ``name`` of a decoder layer, split ``style``-wise.

    A LoRA layer (PEFT's, around its ``base_layer``) adds ``x A^T B^T * scaling`` to the base
    layer's output; its adapters follow the base layer so that the sum is split as the output is:

    * column-wise base (``W [out, in]`` split on ``out``): ``B [out, r]`` split on ``out`` too
      (column-wise), ``A [r, in]`` replicated. ``x A^T`` is whole on every rank; the gradient
      arriving at it is summed over the group (the column-wise input's backward), so ``A``'s
      gradient is the whole one on every rank, like a norm's;
    * row-wise base (``W`` split on ``in``, its input split on the features): ``A`` split on
      ``in`` (row-wise: the partial ``x_r A_r^T`` summed over the group), ``B`` replicated (it
      reads the whole ``[.., r]`` sum; its gradient is the same on every rank).
    """
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if not hasattr(module, "base_layer"):
        return {name: styles[style]()}
    split = "lora_B" if style == "colwise" else "lora_A"
    plan = {f"{name}.base_layer": styles[style]()}
    plan |= {f"{name}.{split}.{adapter}": styles[style]() for adapter in getattr(module, split)}
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split ``model`` (an HF causal LM or token/sequence classifier, checked by
    :func:`check_tensor_parallel_fits`; with LoRA, PEFT's model) over the one-dimensional
    ``tp_mesh``, in place."""
    for layer in decoder_layers(model):
        plan = {}
        for name, style in layer_plan(layer).items():
            plan |= module_plan(layer.get_submodule(name), name, style)
        parallelize_module(layer, tp_mesh, plan)
        for name in HEAD_NORMS:
            if _submodule(layer, name) is not None:
                _split_over_heads(layer.get_submodule(name), tp_mesh)
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and head.weight is embedding.weight
    parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    if tied:  # the head reads the embedding's weight, split already
        head.weight = embedding.weight
    elif head is not None:
        head.weight = nn.Parameter(
            distribute_tensor(head.weight.detach(), tp_mesh, [Shard(0)]),
            requires_grad=head.weight.requires_grad,
        )
