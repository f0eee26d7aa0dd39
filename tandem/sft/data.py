"""SFT data: chat conversations from parquet or JSONL, tokenised with the model's chat template.

Each row holds a list of messages (``{"role": ..., "content": ...}``). The loss covers only
the assistant's tokens: for every assistant turn, the tokens that rendering the turn adds
after the prompt (``apply_chat_template(messages[:i], add_generation_prompt=True)``) are
marked in ``loss_mask``. Rows that are malformed get an error naming the row and field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.config.validation import check_choice, check_positive
from tandem.data.rows import read_rows
from tandem.models.chat import check_message, template_ids
from tandem.protocol import Batch

TRUNCATION = ("error", "right", "drop")


@dataclass(frozen=True)
class SFTDataConfig:
    """Where the conversations are and how to cut them (``data.*``).

    Attributes:
        train_path / val_path: parquet (``.parquet``) or JSON-lines (``.jsonl``) files.
        messages_key: the column holding the message list.
        max_length: longest tokenised conversation kept.
        truncation: for longer ones: ``error`` (name the row), ``right`` (cut the end) or ``drop`` (skip, counted).
    """

    train_path: str = ""
    val_path: str | None = None
    messages_key: str = "messages"
    max_length: int = 1024
    truncation: str = "error"

    def __post_init__(self) -> None:
        check_positive("data", "max_length", self.max_length)
        check_choice("data", "truncation", self.truncation, TRUNCATION)


def tokenize_conversation(tokenizer: Any, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of one conversation; ``where`` names the row in errors."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list, got {type(messages).__name__}")
    for turn, message in enumerate(messages):
        check_message(message, f"{where}: message {turn}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message, so nothing to learn")
    first = next(turn for turn, m in enumerate(messages) if m["role"] != "system")
    if messages[first]["role"] == "assistant":
        raise ValueError(
            f"{where}: message {first} is the assistant's, before any user message; "
            "a conversation must open (after any system message) with the user"
        )
    input_ids = template_ids(tokenizer, messages, add_generation_prompt=False)
    loss_mask = [0] * len(input_ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = template_ids(tokenizer, messages[:turn], add_generation_prompt=True)
        through = template_ids(tokenizer, messages[: turn + 1], add_generation_prompt=False)
        if through[: len(prompt)] != prompt or input_ids[: len(through)] != through:
            raise ValueError(f"{where}: the chat template does not render turn {turn} as a prefix extension")
        for position in range(len(prompt), len(through)):
            loss_mask[position] = 1
    return input_ids, loss_mask


@dataclass
class SFTDataset:
    """Tokenised conversations: ``samples[i] = (input_ids, loss_mask)``; ``dropped`` counts over-long rows skipped."""

    samples: list[tuple[list[int], list[int]]]
    dropped: int = 0

    @staticmethod
    def load(path: str | Path, tokenizer: Any, config: SFTDataConfig) -> SFTDataset:
        samples, dropped = [], 0
        for index, row in enumerate(read_rows(path)):
            where = f"{path}: row {index}"
            if config.messages_key not in row:
                raise ValueError(f"{where}: missing field {config.messages_key!r} (has {sorted(row)})")
            ids, mask = tokenize_conversation(tokenizer, row[config.messages_key], where)
            if len(ids) > config.max_length:
                if config.truncation == "error":
                    raise ValueError(
                        f"{where}: {len(ids)} tokens exceed data.max_length={config.max_length} "
                        "(set data.truncation=right or drop)"
                    )
                if config.truncation == "drop":
                    dropped += 1
                    continue
                ids, mask = ids[: config.max_length], mask[: config.max_length]
            samples.append((ids, mask))
        if not samples:
            raise ValueError(f"{path}: no usable rows ({dropped} dropped as too long)")
        return SFTDataset(samples, dropped)

    def __len__(self) -> int:
        return len(self.samples)

    def collate(self, indices: list[int], pad_id: int) -> Batch:
        """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` (``[B, S]``) of the given rows."""
        rows = [self.samples[i] for i in indices]
        length = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), length), dtype=torch.long)
        loss_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for row, (ids, mask) in enumerate(rows):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            loss_mask[row, : len(mask)] = torch.tensor(mask)
        return Batch({"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask})
