"""Mixture-of-experts statistics of one forward: expert load, routing disagreement, the
load-balancing auxiliary loss. Pure functions of the routers' tensors (:class:`RouterCall`)."""

from __future__ import annotations

import math

import torch
from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

from tandem.models.moe import RouterCall


def expert_shares(experts: torch.Tensor, token_mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` the share of routed slots each expert got: ``experts [N, k]`` over the tokens
    where ``token_mask [N]`` is true (shares sum to 1; all 0 without a token)."""
    picked = experts[token_mask.bool()].reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.float32, device=experts.device)
    counts.index_add_(0, picked, torch.ones_like(picked, dtype=torch.float32))
    return counts / counts.sum().clamp(min=1.0)


def load_metrics(
    calls: list[RouterCall], token_mask: torch.Tensor, num_experts: int
) -> dict[str, torch.Tensor]:
    """Expert load of the experts that ran, averaged over the MoE layers.

    ``moe/load_max_share``: the busiest expert's share of the routed slots (``1 / E`` when
    perfectly balanced, at most ``1 / k`` because a token's k experts differ: one expert in every
    token's top-k); ``moe/load_entropy``: the entropy of the shares divided by ``log E`` (1:
    balanced, lower: concentrated).
    """
    shares = torch.stack([expert_shares(call.used, token_mask, num_experts) for call in calls])  # [L, E]
    entropy = -(shares * shares.clamp(min=1e-12).log()).sum(-1) / math.log(num_experts)
    return {"moe/load_max_share": shares.amax(-1).mean(), "moe/load_entropy": entropy.mean()}


def routing_disagreement(
    calls: list[RouterCall], recorded: torch.Tensor, token_mask: torch.Tensor
) -> torch.Tensor:
    """The fraction of (token, MoE layer) pairs whose live top-k set differs from ``recorded
    [N, L, k]`` (the rollout's), over the tokens where ``token_mask [N]`` is true and the rollout
    recorded a choice (ids >= 0). Compared as sets: the order within the top-k does not count."""
    live = torch.stack([call.live for call in calls], dim=1).sort(-1).values  # [N, L, k]
    recorded = recorded.to(live.device, torch.long).sort(-1).values
    counted = token_mask.bool()[:, None] & (recorded >= 0).all(-1)  # [N, L]
    differs = (live != recorded).any(-1) & counted
    return differs.sum().float() / counted.sum().clamp(min=1).float()


def load_balancing_loss(
    calls: list[RouterCall], token_mask: torch.Tensor, num_experts: int, top_k: int
) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss of the live router logits over the tokens of
    ``token_mask [N]``: HF's ``load_balancing_loss_func`` (``E * sum_e f_e * P_e`` over all
    MoE layers, ``f_e`` the fraction of top-k slots routed to ``e``, ``P_e`` its mean router
    probability); a 0-d tensor with the router weights' gradient."""
    logits = tuple(call.logits for call in calls)
    return load_balancing_loss_func(logits, num_experts, top_k, token_mask.reshape(1, -1))
