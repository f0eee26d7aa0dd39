"""One forward of the training engine: :class:`ForwardRequest`, what the wrapped model is handed
for one micro-batch, built once from its padded rows, and moved to the device once.

A micro-batch runs packed (its valid tokens end to end in one row ``[1, T]``, fillers appended
to a multiple of ``pad_tokens_to_multiple`` and of ``sp_size``) or padded (the window of
columns its rows use, ``[B, W]``). Beside the tokens, positions and attention layout, a forward
carries *side tensors* laid out like its tokens; each is taken from the padded rows by one rule:

- packed: :func:`~tandem.engine.packing.pack_per_token` with the field's fill value at fillers
  (:data:`SIDE_FIELDS`); padded: the window's columns;
- under sequence parallelism, a field read per token by this rank's layers (the routers) is cut
  to this rank's shard (:meth:`~tandem.engine.ulysses.SequenceParallel.shard`); one read at the
  whole row's predicted tokens (the head's gather ids) stays whole.

A vision-language model's images and M-RoPE positions (:class:`VisionInputs`) travel whole: the
vision tower and the merge into the embeddings run on every rank, and the decoder shards the
merged embeddings and positions like its tokens (:func:`tandem.engine.token_model.decoder_hidden_states`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from tandem.device import to_device
from tandem.engine.base import GATHER_FIELD
from tandem.engine.moe_routing import ROUTING_FIELD
from tandem.engine.packing import PackedSequences, Predictions, pack_per_token
from tandem.engine.ulysses import SequenceParallel
from tandem.engine.varlen_attention import AttentionPlan
from tandem.engine.vision_inputs import VisionInputs

REAL_TOKENS = "real_tokens"  # [B, S] bool: the tokens that are neither padding nor fillers (the routers')


@dataclass(frozen=True)
class SideField:
    """How one per-token side tensor is laid out: ``fill`` at packed fillers, and whether a
    sequence-parallel rank keeps only its shard (``sharded``) or the whole row."""

    fill: int | float | bool
    sharded: bool


SIDE_FIELDS: dict[str, SideField] = {
    ROUTING_FIELD: SideField(fill=-1, sharded=True),  # [.., L, k] recorded experts: -1 routes live
    REAL_TOKENS: SideField(fill=False, sharded=True),
    GATHER_FIELD: SideField(fill=0, sharded=False),  # [.., k] the head gathers at whole-row targets
}


@dataclass(frozen=True)
class ForwardRequest:
    """What a wrapped model (:class:`~tandem.engine.token_model.TokenLogProbModel`, the value and
    reward heads) computes one micro-batch from.

    Attributes:
        input_ids: ``[1, T]`` packed (fillers included) or ``[B, W]`` a padded window.
        position_ids: like ``input_ids``: each token's position in its own sequence.
        attention_mask: ``[B, W]`` for a padded window; ``None`` when packed.
        attention_plan: which packed positions each sequence attends over; ``None`` when padded.
        predictions: which hidden states predict which tokens (packed); ``None``: each token from
            the one before it in its sequence.
        side: per-token side tensors by field name (:data:`SIDE_FIELDS`), ``[B', T', ...]`` laid
            out like the tokens (this rank's shard ``[1, T / P, ...]`` for a sharded field).
        vision: a vision-language model's images and M-RoPE positions (whole row), else None.
        sequence_parallel: the group a packed row is split over, or None.
        with_sum_pi_squared / top_k: the policy head's extra outputs (see
            :meth:`~tandem.engine.torch_engine.TorchTrainEngine.forward_backward`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    attention_plan: AttentionPlan | None = None
    predictions: Predictions | None = None
    side: dict[str, torch.Tensor] = field(default_factory=dict)
    vision: VisionInputs | None = None
    sequence_parallel: SequenceParallel | None = None
    with_sum_pi_squared: bool = False
    top_k: int = 0

    @property
    def gather_ids(self) -> torch.Tensor | None:
        """``[B', T', k]`` the tokens whose log-probs each position names, or None."""
        return self.side.get(GATHER_FIELD)

    def routers(self) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """What an MoE model's routers are handed (:meth:`MicroBatchRouting.start
        <tandem.engine.moe_routing.MicroBatchRouting.start>`): the recorded experts ``[N, L, k]``
        (None: not recorded) and the real-token mask ``[N]`` of the ``N`` tokens this rank's
        routers see, flattened; None when the request carries no routing scope."""
        if REAL_TOKENS not in self.side:
            return None
        recorded = self.side.get(ROUTING_FIELD)
        return None if recorded is None else recorded.flatten(0, 1), self.side[REAL_TOKENS].flatten(0, 1)

    def to(self, device: torch.device) -> ForwardRequest:
        """The same request with every tensor on ``device`` (built on the CPU, run anywhere)."""
        return dataclasses.replace(
            self,
            input_ids=to_device(self.input_ids, device),
            position_ids=to_device(self.position_ids, device),
            attention_mask=None if self.attention_mask is None else to_device(self.attention_mask, device),
            attention_plan=None if self.attention_plan is None else self.attention_plan.to(device),
            predictions=None if self.predictions is None else self.predictions.to(device),
            side={name: to_device(values, device) for name, values in self.side.items()},
            vision=None if self.vision is None else self.vision.to(device),
        )


def side_rows(
    attention_mask: torch.Tensor, fields: dict[str, torch.Tensor], routes: bool
) -> dict[str, torch.Tensor]:
    """The side tensors ``[B, S, ...]`` of a micro-batch's padded rows that its forward carries:
    the batch's ``fields`` named in :data:`SIDE_FIELDS` (gather ids; recorded routing only when
    the forward ``routes``, an MoE model's routing scope) and, when it routes, the real tokens."""
    rows = {name: values for name, values in fields.items() if name in SIDE_FIELDS and name != REAL_TOKENS}
    if not routes:
        rows.pop(ROUTING_FIELD, None)
        return rows
    return {**rows, REAL_TOKENS: attention_mask.bool()}


def packed_request(
    packed: PackedSequences,
    rows: dict[str, torch.Tensor],
    sequence_parallel: SequenceParallel | None = None,
    **settings,
) -> ForwardRequest:
    """The request of ``packed`` (fillers appended, predictions found) with the side tensors
    ``rows [B, S, ...]`` of its padded rows packed and, for a sharded field, cut to this rank's
    shard. ``settings``: ``vision``, ``with_sum_pi_squared``, ``top_k``."""
    side = {}
    for name, values in rows.items():
        rule = SIDE_FIELDS[name]
        laid_out = pack_per_token(values, packed, fill=rule.fill)
        if rule.sharded and sequence_parallel is not None:
            laid_out = sequence_parallel.shard(laid_out)
        side[name] = laid_out
    return ForwardRequest(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_plan=packed.attention_plan,
        predictions=packed.predictions,
        side=side,
        sequence_parallel=sequence_parallel,
        **settings,
    )


def used_columns(attention_mask: torch.Tensor) -> slice:
    """The columns of ``attention_mask [B, S]`` from the first to the last any row uses (a padded
    micro-batch computes only those: its rows may be shorter than the batch's longest)."""
    used = attention_mask.any(0).nonzero().flatten()
    return slice(int(used[0]), int(used[-1]) + 1) if used.numel() else slice(0, 1)


def padded_request(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    rows: dict[str, torch.Tensor],
    window: slice,
    **settings,
) -> ForwardRequest:
    """The request of the padded rows ``input_ids [B, S]`` over the columns ``window``, every side
    tensor of ``rows [B, S, ...]`` cut to the same columns (``vision`` in ``settings`` too)."""
    vision = settings.pop("vision", None)
    return ForwardRequest(
        input_ids=input_ids[:, window],
        position_ids=position_ids[:, window],
        attention_mask=attention_mask[:, window],
        side={name: values[:, window] for name, values in rows.items()},
        vision=None if vision is None else vision.window(window),
        **settings,
    )


def check_head_request(head: str, with_sum_pi_squared: bool, top_k: int, gathers: bool) -> None:
    """Refuse, naming ``engine.head``, a policy head's output asked of a value or reward head
    (they score with a scalar head: there is no token distribution to read)."""
    if head == "lm":
        return
    asked = {
        "with_sum_pi_squared": with_sum_pi_squared,
        "top_k": bool(top_k),
        f"the batch's {GATHER_FIELD!r}": gathers,
    }
    named = [name for name, applies in asked.items() if applies]
    if named:
        raise ValueError(
            f"engine.head={head!r} has no token distribution: {', '.join(named)} asks for a policy's "
            "(engine.head='lm') outputs"
        )
