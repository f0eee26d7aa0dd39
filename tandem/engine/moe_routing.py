"""The training engine's side of a mixture-of-experts model: routing replay, the load-balancing
loss and the routing metrics of each micro-batch (see docs/moe.md).

One :class:`MicroBatchRouting` lives for one micro-batch, forward and backward: replay stays
on through backward because gradient checkpointing recomputes the forward there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed import ProcessGroup

from tandem.engine.config import EngineConfig
from tandem.engine.ulysses import gather_sequence
from tandem.models.moe import RouterCall, RouterTap, is_moe
from tandem.models.moe_metrics import load_balancing_loss, load_metrics, routing_disagreement

ROUTING_FIELD = "routed_experts"  # [B, S, L, k] the rollout's experts per token and MoE layer
METRIC_PREFIX = "moe/"  # the routing metrics: each a micro-batch's mean (not a sum over its rows)


def check_moe_settings(config: EngineConfig, model: nn.Module) -> None:
    """Refuse MoE settings on a dense model, naming the field."""
    if is_moe(model):
        return
    if config.moe_aux_loss_coef:
        raise ValueError(
            f"engine.moe_aux_loss_coef={config.moe_aux_loss_coef}: {type(model).__name__} has no "
            "mixture-of-experts layers; set it to 0"
        )
    if config.router_replay != "off":
        raise ValueError(
            f"engine.router_replay={config.router_replay!r}: {type(model).__name__} has no "
            "mixture-of-experts layers; set it to 'off'"
        )


class EngineRouting:
    """What the engine does with an MoE model's routers (None of it for a dense model).

    ``sequence_group``: under sequence parallelism, the ranks a micro-batch's rows are split
    over. The load-balancing loss and the routing metrics are then computed over the whole
    micro-batch on every rank of the group (its routers' tensors gathered), so they equal one
    process's; each rank's backward keeps its own tokens' share of the gradient, as the
    log-probs' does (:func:`~tandem.engine.ulysses.gather_sequence`).
    """

    def __init__(
        self, config: EngineConfig, model: nn.Module, sequence_group: ProcessGroup | None = None
    ) -> None:
        check_moe_settings(config, model)
        self.tap = RouterTap(model) if is_moe(model) else None
        self.replay = config.router_replay == "rollout"
        self.aux_loss_coef = config.moe_aux_loss_coef
        self.sequence_group = sequence_group

    def check_batch(self, fields: set[str]) -> None:
        """Refuse a replaying step whose batch carries no recorded routing."""
        if self.tap is not None and self.replay and ROUTING_FIELD not in fields:
            raise ValueError(
                f"engine.router_replay='rollout' needs the batch's {ROUTING_FIELD!r} (recorded by the native "
                "and hf rollout engines; the vllm engine records none)"
            )

    @contextlib.contextmanager
    def micro_batch(self) -> Iterator[MicroBatchRouting | None]:
        """The routing scope of one micro-batch's forward and backward (None for a dense model)."""
        if self.tap is None:
            yield None
            return
        scope = MicroBatchRouting(self)
        with contextlib.ExitStack() as stack:
            scope.stack = stack
            yield scope


class MicroBatchRouting:
    """One micro-batch: :meth:`start` before its forward, then its aux loss and metrics."""

    def __init__(self, owner: EngineRouting) -> None:
        self.owner = owner
        self.tap = owner.tap
        self.stack: contextlib.ExitStack | None = None
        self.recorded: torch.Tensor | None = None
        self.token_mask: torch.Tensor | None = None
        self._whole: tuple[list[RouterCall], torch.Tensor, torch.Tensor | None] | None = None

    def start(self, recorded: torch.Tensor | None, token_mask: torch.Tensor) -> None:
        """Before the forward: the rollout's routing ``recorded [N, L, k]`` of its ``N`` tokens
        (flattened ``[B, S]`` order, as the routers see them; this rank's shard under sequence
        parallelism; None: not recorded) and which of them are real ``token_mask [N]`` (not
        padding or fillers). Replays ``recorded`` when ``engine.router_replay='rollout'``."""
        self.recorded, self.token_mask = recorded, token_mask
        self._whole = None
        replayed = recorded if self.owner.replay else None
        self.stack.enter_context(self.tap.replaying(replayed))

    @property
    def real_tokens(self) -> torch.Tensor:
        """The micro-batch's real tokens (every sequence-parallel rank's), 0-d."""
        return self._gathered()[1].sum()

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of this forward's real tokens (0-d, with gradient)."""
        calls, token_mask, _ = self._gathered()
        return load_balancing_loss(calls, token_mask, self.tap.num_experts, self.tap.top_k)

    def metrics(self) -> dict[str, torch.Tensor]:
        """``moe/load_max_share``, ``moe/load_entropy`` and, with recorded routing,
        ``moe/routing_disagreement`` (the trainer's live choice against the rollout's)."""
        calls, token_mask, recorded = self._gathered()
        metrics = load_metrics(calls, token_mask, self.tap.num_experts)
        if recorded is not None:
            metrics["moe/routing_disagreement"] = routing_disagreement(calls, recorded, token_mask)
        return {name: value.detach() for name, value in metrics.items()}

    def _gathered(self) -> tuple[list[RouterCall], torch.Tensor, torch.Tensor | None]:
        """The forward's router calls, token mask and recorded routing, of the whole micro-batch:
        gathered over the sequence-parallel group (once per forward: every rank of the group
        asks in the same order), this rank's alone without one."""
        if self._whole is None:
            calls = [self.tap.calls[layer] for layer in range(self.tap.num_layers)]
            group = self.owner.sequence_group
            if group is None:
                self._whole = calls, self.token_mask, self.recorded
            else:
                calls = [
                    RouterCall(*(gather_sequence(t, group, 0) for t in (call.logits, call.live, call.used)))
                    for call in calls
                ]  # fmt: skip
                mask = gather_sequence(self.token_mask.to(torch.int32), group, 0).bool()
                recorded = (
                    None
                    if self.recorded is None
                    else gather_sequence(self.recorded.to(torch.int32), group, 0)
                )
                self._whole = calls, mask, recorded
        return self._whole
