"""Preference data: ``prompt`` (chat messages), ``chosen`` and ``rejected`` responses, from
parquet or JSONL, tokenised with the model's chat template.

A row's ``prompt`` is a list of messages (or a string: one user message); ``chosen`` and
``rejected`` are each an assistant message, a list of messages that continue the prompt, or
a string (one assistant message). A response's tokens are what rendering the prompt plus the
response adds after ``apply_chat_template(prompt, add_generation_prompt=True)`` — the turn's
closing tokens included, as in SFT — and all of them are scored.

Bad pairs (a missing field, an empty response, chosen identical to rejected, a template that
does not extend the prompt) are an error naming the file, row and field, or with
``data.invalid_pairs=drop`` are skipped and counted; pairs longer than ``data.max_length``
likewise with ``data.overlong_pairs``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.config.paths import INPUT_PATH, path_field
from tandem.config.validation import check_choice, check_positive
from tandem.data.rows import read_rows
from tandem.models.chat import check_message, template_ids
from tandem.models.chat_literal import SPECIAL_TOKENS_IN_TEXT
from tandem.protocol import Batch

POLICIES = ("error", "drop")


@dataclass(frozen=True)
class PreferenceDataConfig:
    """Where the pairs are and what to do with bad or long ones (``data.*``).

    Attributes:
        train_path / val_path: parquet or JSONL files of pairs.
        prompt_key / chosen_key / rejected_key: the columns of pairs.
        completion_key / label_key: the columns of unpaired rows (KTO): a completion and whether
            it is desirable (a boolean).
        max_length: most tokens of prompt + the longer response.
        overlong_pairs: ``drop`` (skip, counted) or ``error`` (name the row).
        invalid_pairs: ``error`` (name the row and what is wrong) or ``drop`` (skip, counted).
        special_tokens_in_text: ``text`` (a special-token string inside a message, such as
            ``<|im_end|>``, is tokenized as plain text) or ``control`` (it becomes that control
            token, as transformers' ``apply_chat_template`` does).
    """

    train_path: str = path_field(INPUT_PATH)
    val_path: str | None = path_field(INPUT_PATH, None)
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    completion_key: str = "completion"
    label_key: str = "label"
    max_length: int = 1024
    overlong_pairs: str = "drop"
    invalid_pairs: str = "error"
    special_tokens_in_text: str = "text"

    def __post_init__(self) -> None:
        check_choice("data", "special_tokens_in_text", self.special_tokens_in_text, SPECIAL_TOKENS_IN_TEXT)
        check_positive("data", "max_length", self.max_length)
        check_choice("data", "overlong_pairs", self.overlong_pairs, POLICIES)
        check_choice("data", "invalid_pairs", self.invalid_pairs, POLICIES)


@dataclass(frozen=True)
class PreferencePair:
    """One tokenised pair: the prompt (with the generation prompt) and each response's tokens."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]

    @property
    def length(self) -> int:
        """Tokens of the prompt plus the longer response (what ``data.max_length`` bounds)."""
        return len(self.prompt) + max(len(self.chosen), len(self.rejected))


class InvalidPair(ValueError):
    """A row that is not a usable preference pair; the message names the row and the field."""


def _messages(value: Any, default_role: str, where: str) -> list[dict]:
    if isinstance(value, str):
        value = [{"role": default_role, "content": value}]
    elif isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidPair(
            f"{where} must be a string, a message or a non-empty list of messages, got {value!r}"
        )
    for turn, message in enumerate(value):
        try:
            check_message(message, f"{where} message {turn}")
        except ValueError as error:
            raise InvalidPair(str(error)) from None
    return list(value)


def _response_ids(
    tokenizer: Any,
    prompt: list[dict],
    prompt_ids: list[int],
    response: list[dict],
    where: str,
    special_tokens_in_text: str = "text",
) -> list[int]:
    if response[0]["role"] != "assistant":
        raise InvalidPair(f"{where} must start with an assistant message, got role {response[0]['role']!r}")
    full = template_ids(tokenizer, prompt + response, False, special_tokens_in_text=special_tokens_in_text)
    if full[: len(prompt_ids)] != prompt_ids:
        raise InvalidPair(
            f"{where}: the chat template does not render the response as a continuation of the prompt"
        )
    ids = full[len(prompt_ids) :]
    if not ids:
        raise InvalidPair(f"{where} renders to no tokens")
    return ids


def row_prompt(
    row: dict, required: tuple[str, ...], prompt_key: str, continued_by: str, where: str
) -> list[dict]:
    """The prompt messages of ``row``, after checking that it has every ``required`` field and that
    its prompt does not end with the assistant's turn (``continued_by`` says what continues it); raises
    :class:`InvalidPair` naming ``where`` and the field."""
    missing = [key for key in required if row.get(key) is None]
    if missing:
        raise InvalidPair(f"{where}: missing field {missing[0]!r} (has {sorted(row)})")
    prompt = _messages(row[prompt_key], "user", f"{where}: {prompt_key}")
    if prompt[-1]["role"] == "assistant":
        raise InvalidPair(f"{where}: {prompt_key} ends with an assistant message; {continued_by}")
    return prompt


def tokenize_pair(tokenizer: Any, row: dict, config: PreferenceDataConfig, where: str) -> PreferencePair:
    """The pair in ``row``; raises :class:`InvalidPair` naming ``where`` and the field."""
    keys = (config.prompt_key, config.chosen_key, config.rejected_key)
    prompt = row_prompt(row, keys, config.prompt_key, "the responses continue it", where)
    chosen = _messages(row[config.chosen_key], "assistant", f"{where}: {config.chosen_key}")
    rejected = _messages(row[config.rejected_key], "assistant", f"{where}: {config.rejected_key}")
    if chosen == rejected:
        raise InvalidPair(
            f"{where}: {config.chosen_key} and {config.rejected_key} are identical, so there is no preference"
        )
    literal = config.special_tokens_in_text
    prompt_ids = template_ids(tokenizer, prompt, True, special_tokens_in_text=literal)
    return PreferencePair(
        prompt_ids,
        _response_ids(tokenizer, prompt, prompt_ids, chosen, f"{where}: {config.chosen_key}", literal),
        _response_ids(tokenizer, prompt, prompt_ids, rejected, f"{where}: {config.rejected_key}", literal),
    )


def tokenized_rows(
    path: str | Path, tokenize: Callable[..., Any], config: PreferenceDataConfig, dataset: Any
) -> Iterator[tuple[int, str, Any]]:
    """``(row number, "<path>: row N", tokenize(row, where=...))`` for each usable row of ``path``.
    A row ``tokenize`` finds invalid raises (``data.invalid_pairs=error``) or is counted in
    ``dataset.invalid`` and skipped."""
    for index, row in enumerate(read_rows(path)):
        where = f"{path}: row {index}"
        try:
            tokenized = tokenize(row, where=where)
        except InvalidPair:
            if config.invalid_pairs == "error":
                raise
            dataset.invalid += 1
            continue
        yield index, where, tokenized


def pair_layout(
    prompts: list[list[int]], responses: list[list[int]], width: int, response_width: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """Rows of ``prompts[i]`` then ``responses[i]`` in the RL layout: the prompt left-padded in
    ``prompts [R, width]``, the response right-padded after it, ``input_ids`` / ``attention_mask``
    ``[R, width + response_width]`` and ``loss_mask`` on the response tokens."""
    input_ids = torch.full((len(prompts), width + response_width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    loss_mask = torch.zeros_like(input_ids)
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        input_ids[row, width - len(prompt) : width] = torch.tensor(prompt)
        input_ids[row, width : width + len(response)] = torch.tensor(response)
        attention[row, width - len(prompt) : width + len(response)] = 1
        loss_mask[row, width : width + len(response)] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "prompts": input_ids[:, :width].clone(),
    }


@dataclass
class PreferenceDataset:
    """Tokenised pairs, with counts of the rows skipped as invalid or too long. Per kept pair,
    whatever ``pairs`` holds: ``rows[i]`` (its row number in the file) and ``lengths[i]`` (its
    prompt's, chosen's and rejected's tokens). Loaded with ``keep_tokens=False`` the set holds
    only those (``pairs`` empty): the controller's view when the ranks collate their own rows."""

    pairs: list[PreferencePair]
    invalid: int = 0
    overlong: int = 0
    rows: list[int] = field(default_factory=list)  # each pair's row number in the file
    lengths: list[tuple[int, int, int]] = field(default_factory=list)

    @staticmethod
    def load(
        path: str | Path, tokenizer: Any, config: PreferenceDataConfig, keep_tokens: bool = True
    ) -> PreferenceDataset:
        dataset = PreferenceDataset([])
        tokenize = functools.partial(tokenize_pair, tokenizer, config=config)
        for index, where, pair in tokenized_rows(path, tokenize, config, dataset):
            if pair.length > config.max_length:
                if config.overlong_pairs == "error":
                    raise ValueError(
                        f"{where}: {pair.length} tokens (prompt + longer response) exceed "
                        f"data.max_length={config.max_length} (set data.overlong_pairs=drop to skip such pairs)"
                    )
                dataset.overlong += 1
                continue
            dataset.keep(pair, index, keep_tokens)
        if not dataset.rows:
            raise ValueError(
                f"{path}: no usable pairs ({dataset.invalid} invalid, {dataset.overlong} over data.max_length dropped)"
            )
        return dataset

    def keep(self, pair: PreferencePair, file_row: int, keep_tokens: bool) -> None:
        """Add ``pair`` (of the file's row ``file_row``): its tokens too when ``keep_tokens``."""
        self.rows.append(file_row)
        self.lengths.append((len(pair.prompt), len(pair.chosen), len(pair.rejected)))
        if keep_tokens:
            self.pairs.append(pair)

    def __len__(self) -> int:
        return len(self.rows)

    def widths(self, indices: list[int]) -> tuple[int, int]:
        """The prompt and response widths of the pairs ``indices`` collated together."""
        lengths = [self.lengths[i] for i in indices]
        return max(p for p, _, _ in lengths), max(max(c, r) for _, c, r in lengths)

    def pair_fields(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The per-row fields of the pairs ``indices`` as ``2P`` rows (see :meth:`collate`)."""
        return {
            "pair": torch.tensor(indices, dtype=torch.long).repeat_interleave(2),
            "chosen": torch.tensor([1, 0] * len(indices), dtype=torch.long),
            "micro_batch_unit": torch.arange(len(indices)).repeat_interleave(2),
        }

    def collate(self, indices: list[int], pad_id: int) -> Batch:
        """The pairs ``indices`` as ``2P`` rows, chosen then rejected for each pair, in the RL
        layout (:func:`pair_layout`): ``prompts [2P, Lp]``, ``input_ids`` / ``attention_mask`` /
        ``loss_mask`` ``[2P, Lp + Lr]``, ``pair [2P]`` (the pair's dataset index), ``chosen [2P]``
        (1 for chosen), and ``micro_batch_unit [2P]`` (the pair's two rows never go to different
        micro-batches). A set loaded with ``keep_tokens=False`` has no tokens to collate."""
        if len(self.pairs) < len(self.rows):
            raise ValueError(
                "this preference set was loaded without its tokens (dataplane.enabled: the ranks "
                "collate their own rows); load it with keep_tokens=True to collate on the controller"
            )
        pairs = [self.pairs[i] for i in indices]
        prompts = [pair.prompt for pair in pairs for _ in range(2)]
        responses = [response for pair in pairs for response in (pair.chosen, pair.rejected)]
        width, response_width = self.widths(indices)
        return Batch(
            {**pair_layout(prompts, responses, width, response_width, pad_id), **self.pair_fields(indices)}
        )
