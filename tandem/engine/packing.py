"""Sequence packing ("remove padding"): the valid tokens of a padded batch laid end to end in one row.

Each sequence keeps its own positions (``0..len-1``), so attention implementations that
read packed ``position_ids`` (transformers' SDPA/eager masks, flash-attention varlen)
never attend across a sequence boundary. Padding may sit on either side of a row
(left-padded prompts, right-padded responses); only ``attention_mask`` decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedSequences:
    """A padded ``[B, S]`` batch packed into one row of ``T`` valid tokens.

    Attributes:
        input_ids: ``[1, T]`` token ids of all sequences, one after another.
        position_ids: ``[1, T]`` position of each token inside its own sequence.
        cu_seqlens: ``[B + 1]`` int32 cumulative sequence lengths (flash-attention varlen layout).
        flat_index: ``[T]`` where each packed token sits in the flattened ``[B * S]`` padded layout.
        padded_shape: ``(B, S)``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    flat_index: torch.Tensor
    padded_shape: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        return int(self.flat_index.numel())


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` position of each valid token inside its sequence (0 on padding)."""
    mask = attention_mask.long()
    return ((mask.cumsum(-1) - 1) * mask).clamp(min=0)


def pack_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedSequences:
    """Pack the valid tokens of ``input_ids [B, S]`` (where ``attention_mask`` is 1) into one row."""
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ"
        )
    mask = attention_mask.bool()
    flat_index = mask.flatten().nonzero().flatten()
    lengths = mask.sum(-1)
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    return PackedSequences(
        input_ids=input_ids.flatten()[flat_index].unsqueeze(0),
        position_ids=positions_from_mask(attention_mask).flatten()[flat_index].unsqueeze(0),
        cu_seqlens=cu_seqlens,
        flat_index=flat_index,
        padded_shape=(int(input_ids.shape[0]), int(input_ids.shape[1])),
    )


def unpack(values: torch.Tensor, packed: PackedSequences, fill: float = 0.0) -> torch.Tensor:
    """Scatter per-token ``values [T]`` (or ``[1, T]``) back to the padded ``[B, S]`` layout."""
    values = values.reshape(-1)
    batch, length = packed.padded_shape
    out = values.new_full((batch * length,), fill)
    return out.index_put((packed.flat_index,), values).reshape(batch, length)
