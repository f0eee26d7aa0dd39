"""Sequence packing ("remove padding"): the valid tokens of a padded batch laid end to end in one row.

Each sequence keeps its own positions (``0..len-1``), so attention implementations that
read packed ``position_ids`` (transformers' SDPA/eager masks, flash-attention varlen)
never attend across a sequence boundary. Padding may sit on either side of a row
(left-padded prompts, right-padded responses); only ``attention_mask`` decides.

A row may hold several sequences end to end (an agent program's split episode: each segment
its own conversation, :mod:`tandem.agents.program.recorder`): its ``position_ids`` restart at 0
where a segment starts. Given those positions, :func:`pack_sequences` packs each segment as a
sequence of its own, so no token attends to, or is predicted from, another segment's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tandem.device import to_device
from tandem.engine.varlen_attention import AttentionPlan, contiguous_plan


@dataclass(frozen=True)
class Predictions:
    """Which hidden states predict which tokens, as indices into the flattened ``[B * S]`` layout:
    the hidden state at ``sources[i]`` predicts the token at ``targets[i]`` (both ``[N]`` int64)."""

    sources: torch.Tensor
    targets: torch.Tensor

    def to(self, device: torch.device) -> Predictions:
        return Predictions(to_device(self.sources, device), to_device(self.targets, device))


def next_token_predictions(position_ids: torch.Tensor) -> Predictions:
    """Each token predicted from the one before it, except where a sequence starts (position 0)
    and in the first column. ``position_ids [B, S]``."""
    starts = position_ids == 0
    starts[:, 0] = True
    targets = (~starts).flatten().nonzero().flatten()
    return Predictions(targets - 1, targets)


@dataclass(frozen=True)
class PackedSequences:
    """A padded ``[B, S]`` batch packed into one row of ``T`` tokens.

    Attributes:
        input_ids: ``[1, T]`` token ids of all sequences, one after another.
        position_ids: ``[1, T]`` position of each token inside its own sequence.
        cu_seqlens: ``[n + 1]`` int32 cumulative sequence lengths (flash-attention varlen
            layout; ``n = B``, more where rows hold several sequences); ``None`` when
            sequences share packed tokens (shared prompts).
        flat_index: ``[N]`` where packed values land in the flattened ``[B * S]`` padded layout.
        padded_shape: ``(B, S)``.
        attention_plan: which packed positions each sequence attends over.
        token_index: ``[N]`` the packed positions that ``flat_index`` places; ``None``: all
            ``T``, in order (``N = T``).
        predictions: which packed hidden states predict which packed tokens; ``None``: each
            token from the one before it in its sequence.
        source_index: ``[T']`` for each packed token (fillers aside), the flattened ``[B * S]``
            position it was copied from; ``None``: ``flat_index`` (every packed token is one
            padded token, in order).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None
    flat_index: torch.Tensor
    padded_shape: tuple[int, int]
    attention_plan: AttentionPlan
    token_index: torch.Tensor | None = None
    predictions: Predictions | None = None
    source_index: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """``T``, the length of the packed row."""
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device) -> PackedSequences:
        """The same packing with every tensor on ``device`` (packing runs on the CPU, the model anywhere)."""

        def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else to_device(tensor, device)

        return dataclasses.replace(
            self,
            input_ids=to_device(self.input_ids, device),
            position_ids=to_device(self.position_ids, device),
            cu_seqlens=move(self.cu_seqlens),
            flat_index=to_device(self.flat_index, device),
            attention_plan=self.attention_plan.to(device),
            token_index=move(self.token_index),
            predictions=None if self.predictions is None else self.predictions.to(device),
            source_index=move(self.source_index),
        )


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` position of each valid token inside its sequence (0 on padding)."""
    mask = attention_mask.long()
    return ((mask.cumsum(-1) - 1) * mask).clamp(min=0)


def check_same_shape(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ"
        )


def restarts_within_rows(position_ids: torch.Tensor | None, attention_mask: torch.Tensor) -> bool:
    """Whether some row of ``position_ids [B, S]`` holds several sequences: its positions on the
    valid tokens (``attention_mask``) differ from ``0..len-1`` (they restart where a segment
    starts). ``None``: no positions given, one sequence per row."""
    if position_ids is None or position_ids.ndim != 2:  # a VLM's [3, B, S] M-RoPE positions are its own
        return False
    mask = attention_mask.bool()
    return bool((position_ids.to(mask.device)[mask] != positions_from_mask(attention_mask)[mask]).any())


def check_one_sequence_per_row(position_ids: torch.Tensor | None, attention_mask: torch.Tensor) -> None:
    """Raise ``ValueError`` when a row of a padded forward holds several sequences: a 2-D
    attention mask cannot keep them apart (only packing can, :func:`pack_sequences`)."""
    if restarts_within_rows(position_ids, attention_mask):
        raise ValueError(
            "a row holds several sequences (its position_ids restart: an agent program's split episode, "
            "each segment trained in one row), which the padded forward cannot keep apart: set "
            "actor.engine.use_packing=true (and ref.engine.use_packing / critic.engine.use_packing "
            "where a reference or critic runs)"
        )


def _sequence_bounds(positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[n + 1]`` int32 cumulative lengths of the sequences of a packed row whose tokens have
    ``positions [T]``, from rows of ``lengths [B]``: a sequence starts at each row's first token
    and wherever the positions restart at 0 inside a row."""
    starts = positions == 0
    row_starts = torch.cumsum(lengths, 0) - lengths
    starts[row_starts[lengths > 0]] = True
    bounds = torch.cat([starts.nonzero().flatten(), positions.new_tensor([positions.numel()])])
    return bounds.to(torch.int32)


def pack_sequences(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
) -> PackedSequences:
    """Pack the valid tokens of ``input_ids [B, S]`` (where ``attention_mask`` is 1) into one row.

    ``position_ids [B, S]``: each token's position in its own sequence, where a row may hold
    several (restarting at 0: see the module docstring); each then packs as a sequence of its
    own. ``None``: one sequence per row, positions ``0..len-1``.
    """
    check_same_shape(input_ids, attention_mask)
    mask = attention_mask.bool()
    flat_index = mask.flatten().nonzero().flatten()
    lengths = mask.sum(-1)
    if position_ids is None:
        cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=input_ids.device)
        cu_seqlens[1:] = lengths.cumsum(0)
        positions = positions_from_mask(attention_mask).flatten()[flat_index]
    else:
        positions = position_ids.to(input_ids.device).flatten()[flat_index]
        cu_seqlens = _sequence_bounds(positions, lengths)
    return PackedSequences(
        input_ids=input_ids.flatten()[flat_index].unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        flat_index=flat_index,
        padded_shape=(int(input_ids.shape[0]), int(input_ids.shape[1])),
        attention_plan=contiguous_plan(cu_seqlens),
    )


def unpack(values: torch.Tensor, packed: PackedSequences, fill: float = 0.0) -> torch.Tensor:
    """Scatter per-token ``values [T]`` (or ``[1, T, ...]``) back to the padded ``[B, S, ...]`` layout.

    ``packed`` may stay on the CPU (where it was built) while ``values`` are on the model's
    device: its indices follow the values."""
    trailing = values.shape[2:] if values.dim() > 1 else ()
    values = values.reshape(-1, *trailing)
    if packed.token_index is not None:
        values = values.index_select(0, packed.token_index.to(values.device))
    batch, length = packed.padded_shape
    out = values.new_full((batch * length, *trailing), fill)
    return out.index_put((packed.flat_index,), values).reshape(batch, length, *trailing)


def pad_to_multiple(packed: PackedSequences, multiple: int) -> PackedSequences:
    """Append filler tokens so the packed row's length is a multiple of ``multiple``.

    Rows of varying length give the linear layers a new shape every step, and oneDNN builds
    (and caches, holding memory) a kernel per shape; rounded lengths repeat. The fillers
    (token 0 at position 0) are read by no attention query, take their attention output
    from row 0 of the first bucket, predict nothing and are left out by :func:`unpack`, so
    they change no result and receive no gradient.
    """
    total = packed.num_tokens
    pad = -total % multiple
    if pad == 0 or total == 0:
        return packed
    filler = packed.input_ids.new_zeros(1, pad)
    return dataclasses.replace(
        packed,
        input_ids=torch.cat([packed.input_ids, filler], 1),
        position_ids=torch.cat([packed.position_ids, filler], 1),
        attention_plan=packed.attention_plan.with_fillers(pad),
        token_index=packed.token_index if packed.token_index is not None else torch.arange(total),
    )


def pack_per_token(values: torch.Tensor, packed: PackedSequences, fill: int | float = 0) -> torch.Tensor:
    """Lay a per-token field of the padded batch out like the packed row: ``values [B, S, ...]``
    -> ``[1, T, ...]`` (the inverse of :func:`unpack`), ``fill`` at fillers.

    Rows sharing a prompt read one packed copy of it, which takes the values of the group's
    first row (they agree when the field depends on the prompt alone, as routing recorded over
    one computation of the prompt does).
    """
    batch, length = packed.padded_shape
    sources = packed.flat_index if packed.source_index is None else packed.source_index
    flat = values.reshape(batch * length, *values.shape[2:]).index_select(0, sources.to(values.device))
    out = values.new_full((packed.num_tokens, *values.shape[2:]), fill)
    out[: flat.shape[0]] = flat
    return out.unsqueeze(0)
