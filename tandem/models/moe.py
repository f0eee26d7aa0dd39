"""Mixture-of-experts routers: finding them, recording each token's experts, replaying a recorded choice.

HF's Qwen2-MoE and Qwen3-MoE blocks call a top-k router module that returns
``(router_logits [N, E], routing_weights [N, k], selected_experts [N, k])`` for the block's
``N`` tokens (flattened ``[B, S]`` order), then run the experts grouped by expert: one matmul
per expert that any token picked, results added back with ``index_add``
(``transformers`` 5.x ``...Experts.forward``). :class:`RouterTap` hooks every router's output:

- it records the choice each forward made (the rollout engines return it per token), and
- with a ``selection`` (rollout routing replay, R3) it replaces the choice by the recorded
  experts while the weights still come from the live router: ``softmax(logits)`` gathered at
  the recorded experts, renormalised over them when the family renormalises its top-k
  (``norm_topk_prob``). The router's weight therefore keeps its gradient.

A recorded expert id ``-1`` (a token no rollout forward routed, e.g. a response's last token)
leaves that token's routing live.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from tandem.protocol.sequences import ROUTING_DTYPE

ROUTER_CLASSES = (Qwen2MoeTopKRouter, Qwen3MoeTopKRouter)  # softmax -> top-k [-> renormalise] routers
NOT_ROUTED = -1  # a recorded expert id meaning "route this token live"


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers in layer order (empty for a dense model)."""
    return [module for module in model.modules() if isinstance(module, ROUTER_CLASSES)]


def moe_layer_indices(model: nn.Module) -> list[int]:
    """The decoder-layer index of each router of :func:`moe_routers`, in the same order.

    Routing records are indexed by MoE layer (dense layers skipped: Qwen-MoE's ``mlp_only_layers``
    and ``decoder_sparse_step``); an engine that indexes by decoder layer maps through this.
    """
    indices = []
    for name, module in model.named_modules():
        if isinstance(module, ROUTER_CLASSES):
            found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
            if found is None:
                raise ValueError(f"router {name!r} is not inside a numbered decoder layer (layers.N)")
            indices.append(int(found.group(1)))
    return indices


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` has mixture-of-experts layers this module knows how to route."""
    return bool(moe_routers(model))


def replayed_weights(router_logits: torch.Tensor, experts: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The routing weights ``[N, k]`` of ``experts [N, k]`` under ``router_logits [N, E]``.

    ``softmax(router_logits)`` in fp32 gathered at ``experts``, divided by its sum over them
    when ``normalize`` (the family's ``norm_topk_prob``), in the logits' dtype: exactly what the
    router computes for its own top-k, so replaying the live choice changes nothing.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, experts)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)


@dataclass
class RouterCall:
    """One router's view of one forward.

    Attributes:
        logits: ``[N, E]`` the live router logits (with their autograd graph).
        live: ``[N, k]`` the experts the live router picked.
        used: ``[N, k]`` the experts the block ran (``live``, or the replayed selection).
    """

    logits: torch.Tensor
    live: torch.Tensor
    used: torch.Tensor


class RouterTap:
    """Forward hooks on every router of ``model``: they record each forward's routing and, inside
    :meth:`replaying`, replace it by a recorded one (see the module docstring).

    ``calls[layer]`` holds the last forward's :class:`RouterCall` per MoE layer (overwritten, so
    a gradient-checkpointing recompute leaves the same values). Not thread-safe: one forward at
    a time.
    """

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts router")
        first = self.routers[0]
        self.num_experts, self.top_k = int(first.num_experts), int(first.top_k)
        self.selection: torch.Tensor | None = None  # [N, L, k] while replaying
        self.calls: dict[int, RouterCall] = {}
        self._handles = [
            router.register_forward_hook(functools.partial(self._hook, layer))
            for layer, router in enumerate(self.routers)
        ]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @contextlib.contextmanager
    def replaying(self, selection: torch.Tensor | None) -> Iterator[RouterTap]:
        """Inside, the routers run the experts of ``selection [N, L, k]`` (``N``: the forward's
        tokens in flattened ``[B, S]`` order; ``None``: live routing). Keep a training step's
        backward inside too: gradient checkpointing recomputes the forward there."""
        if selection is not None and tuple(selection.shape[1:]) != (self.num_layers, self.top_k):
            raise ValueError(
                f"routed_experts per token must be [layers={self.num_layers}, k={self.top_k}], "
                f"got {tuple(selection.shape[1:])}"
            )
        self.selection = selection
        try:
            yield self
        finally:
            self.selection = None

    def recorded(self) -> torch.Tensor:
        """``[N, L, k]`` the experts the last forward ran, per token and MoE layer, as ``ROUTING_DTYPE``."""
        return torch.stack([self.calls[layer].used for layer in range(self.num_layers)], dim=1).to(
            ROUTING_DTYPE
        )

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int, router: nn.Module, args: tuple, output: tuple) -> tuple:
        logits, weights, live = output
        used = live
        if self.selection is not None:
            recorded = self.selection[:, layer].to(device=live.device, dtype=torch.long)
            if recorded.shape[0] != live.shape[0]:
                raise ValueError(
                    f"routed_experts cover {recorded.shape[0]} tokens; the forward routes {live.shape[0]}"
                )
            unrouted = (recorded < 0).any(-1, keepdim=True)
            used = torch.where(unrouted, live, recorded)
            weights = replayed_weights(logits, used, bool(router.norm_topk_prob)).to(weights.dtype)
        self.calls[layer] = RouterCall(logits, live, used)
        return logits, weights, used
