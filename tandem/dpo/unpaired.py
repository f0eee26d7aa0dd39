"""Unpaired preference data (KTO): rows of ``prompt``, ``completion`` and a boolean ``label``
(desirable or not), from parquet or JSONL, tokenised like pairs (:mod:`tandem.dpo.data`).

KTO's reference point is estimated from mismatched (prompt, completion) pairs: each row's
prompt with the completion of the row before it in the file (the first row takes the last
row's), as TRL's data preparation does within each batch. A row is kept as a
:class:`~tandem.dpo.data.PreferencePair` of its completion (``chosen``) and that mismatched
completion (``rejected``), so it collates, packs (the prompt scored once for both) and gets
its reference log-probs like a pair: column 0 of the reference table is the row's own
completion, column 1 the mismatched one.

Bad rows (a missing field, a label that is not a boolean, an empty completion) are an error
naming the file, row and field, or with ``data.invalid_pairs=drop`` are skipped and counted;
rows longer than ``data.max_length`` likewise with ``data.overlong_pairs``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.dpo.data import (
    InvalidPair,
    PreferenceDataConfig,
    PreferenceDataset,
    PreferencePair,
    _messages,
    _response_ids,
    row_prompt,
    tokenized_rows,
)
from tandem.models.chat import template_ids
from tandem.protocol import Batch


@dataclass(frozen=True)
class UnpairedRow:
    """One tokenised row: the prompt (with the generation prompt), the completion, its label."""

    prompt: list[int]
    completion: list[int]
    desirable: bool


def tokenize_unpaired(tokenizer: Any, row: dict, config: PreferenceDataConfig, where: str) -> UnpairedRow:
    """The row in ``row``; raises :class:`~tandem.dpo.data.InvalidPair` naming ``where`` and the field."""
    keys = (config.prompt_key, config.completion_key, config.label_key)
    prompt = row_prompt(row, keys, config.prompt_key, "the completion continues it", where)
    label = row[config.label_key]
    if not isinstance(label, bool):
        raise InvalidPair(f"{where}: {config.label_key} must be true or false, got {label!r}")
    completion = _messages(row[config.completion_key], "assistant", f"{where}: {config.completion_key}")
    literal = config.special_tokens_in_text
    prompt_ids = template_ids(tokenizer, prompt, True, special_tokens_in_text=literal)
    ids = _response_ids(
        tokenizer, prompt, prompt_ids, completion, f"{where}: {config.completion_key}", literal
    )
    return UnpairedRow(prompt_ids, ids, label)


@dataclass
class UnpairedDataset(PreferenceDataset):
    """Tokenised unpaired rows, each held as the pair (its completion, the mismatched one), with
    each row's label in ``desirable`` and the file row of its mismatched completion in
    ``partner_rows``."""

    desirable: list[bool] = field(default_factory=list)
    partner_rows: list[int] = field(default_factory=list)

    @staticmethod
    def load(
        path: str | Path, tokenizer: Any, config: PreferenceDataConfig, keep_tokens: bool = True
    ) -> UnpairedDataset:
        dataset = UnpairedDataset([])
        kept: list[UnpairedRow] = []
        file_rows: list[int] = []
        tokenize = functools.partial(tokenize_unpaired, tokenizer, config=config)
        for index, _, row in tokenized_rows(path, tokenize, config, dataset):
            kept.append(row)
            file_rows.append(index)
        if len(kept) < 2:
            raise ValueError(
                f"{path}: {len(kept)} usable rows ({dataset.invalid} invalid dropped); KTO needs at least 2 "
                "(its reference point pairs each prompt with another row's completion)"
            )
        for number, row in enumerate(kept):
            pair = PreferencePair(row.prompt, row.completion, kept[number - 1].completion)
            if pair.length > config.max_length:
                if config.overlong_pairs == "error":
                    raise ValueError(
                        f"{path}: row {file_rows[number]}: {pair.length} tokens (prompt + the longer of its completion "
                        f"and the mismatched one) exceed data.max_length={config.max_length} "
                        "(set data.overlong_pairs=drop to skip such rows)"
                    )
                dataset.overlong += 1
                continue
            dataset.keep(pair, file_rows[number], keep_tokens)
            dataset.desirable.append(row.desirable)
            dataset.partner_rows.append(file_rows[number - 1])
        if not dataset.rows:
            raise ValueError(f"{path}: no usable rows ({dataset.overlong} over data.max_length dropped)")
        return dataset

    def collate(self, indices: list[int], pad_id: int) -> Batch:
        """:meth:`PreferenceDataset.collate` of the rows ``indices`` (``chosen [2N]`` is 1 on each
        row's own completion, 0 on its mismatched one), with ``desirable [2N]`` (the row's label)."""
        batch = super().collate(indices, pad_id)
        labels = torch.tensor([self.desirable[i] for i in indices], dtype=torch.long).repeat_interleave(2)
        return batch.assign(tensors={"desirable": labels})
