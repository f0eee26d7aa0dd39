"""SFT data: chat conversations from parquet or JSONL, tokenised with the model's chat template.

Each row holds a list of messages (``{"role": ..., "content": ...}``). The loss covers only
the assistant's tokens: for every assistant turn, the tokens that rendering the turn adds
after the prompt (``apply_chat_template(messages[:i], add_generation_prompt=True)``) are
marked in ``loss_mask``. Rows that are malformed get an error naming the row and field.

For a vision-language model a row may also hold images (``data.images_key``, verl's
``[{"bytes": ...} | {"path": ...}]``) with one ``<image>`` placeholder per image in the
messages' text; the images go through the model's image processor and the batch carries them
in its ``images`` field (:mod:`tandem.models.vision`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.config.paths import INPUT_PATH, path_field
from tandem.config.validation import check_choice, check_positive
from tandem.data.images import DEFAULT_MAX_IMAGE_PIXELS, ImageError, decode_image, entry_bytes
from tandem.data.rows import read_rows
from tandem.models.chat import check_message, template_ids, with_image_parts
from tandem.models.chat_literal import SPECIAL_TOKENS_IN_TEXT
from tandem.models.vision import ImagePrompter, expand_image_tokens
from tandem.protocol import Batch
from tandem.protocol.images import ImageInputs

TRUNCATION = ("error", "right", "drop")


@dataclass(frozen=True)
class SFTDataConfig:
    """Where the conversations are and how to cut them (``data.*``).

    Attributes:
        train_path / val_path: parquet (``.parquet``) or JSON-lines (``.jsonl``) files.
        messages_key: the column holding the message list.
        max_length: longest tokenised conversation kept.
        truncation: for longer ones: ``error`` (name the row), ``right`` (cut the end) or ``drop`` (skip, counted).
            A row with images is never cut: ``right`` refuses it, naming the row.
        images_key: the column holding a row's images (vision-language models).
        min_pixels / max_pixels: the image processor's resizing bounds (None: the model's saved ones).
        max_image_pixels: a larger image (decoded width x height) is an error naming the row.
        special_tokens_in_text: ``text`` (a special-token string inside a message, such as
            ``<|im_end|>``, is tokenized as plain text) or ``control`` (it becomes that control
            token, as transformers' ``apply_chat_template`` does).
    """

    train_path: str = path_field(INPUT_PATH)
    val_path: str | None = path_field(INPUT_PATH, None)
    messages_key: str = "messages"
    max_length: int = 1024
    truncation: str = "error"
    images_key: str = "images"
    min_pixels: int | None = None
    max_pixels: int | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    special_tokens_in_text: str = "text"

    def __post_init__(self) -> None:
        check_choice("data", "special_tokens_in_text", self.special_tokens_in_text, SPECIAL_TOKENS_IN_TEXT)
        check_positive("data", "max_length", self.max_length)
        check_positive("data", "max_image_pixels", self.max_image_pixels)
        check_choice("data", "truncation", self.truncation, TRUNCATION)


def tokenize_conversation(
    tokenizer: Any, messages: list[dict], where: str, images: int = 0, special_tokens_in_text: str = "text"
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of one conversation; ``where`` names the row in errors. With
    ``images`` the messages' ``<image>`` placeholders (as many) become image parts, rendered as
    one placeholder token each. ``special_tokens_in_text``: ``data.special_tokens_in_text``."""
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
    if images:
        messages, placeholders = with_image_parts(messages)
        if placeholders != images:
            raise ValueError(
                f"{where}: the messages hold {placeholders} <image> placeholders and the row {images} images; "
                "each image needs exactly one"
            )

    def render(turns: list[dict], add_generation_prompt: bool) -> list[int]:
        try:
            return template_ids(
                tokenizer, turns, add_generation_prompt, special_tokens_in_text=special_tokens_in_text
            )
        except ValueError as error:  # a typed special token the template's rewriting hides: name the row
            raise ValueError(f"{where}: {error}") from error

    input_ids = render(messages, False)
    loss_mask = [0] * len(input_ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:turn], True)
        through = render(messages[: turn + 1], False)
        if through[: len(prompt)] != prompt or input_ids[: len(through)] != through:
            raise ValueError(f"{where}: the chat template does not render turn {turn} as a prefix extension")
        for position in range(len(prompt), len(through)):
            loss_mask[position] = 1
    return input_ids, loss_mask


def row_images(row: dict, config: SFTDataConfig, base_dir: Path, where: str) -> list:
    """The decoded images of ``row`` (empty when it has none), errors naming the row and image."""
    entries = row.get(config.images_key)
    if entries is None:
        return []
    if not isinstance(entries, (list, tuple)) and not hasattr(entries, "tolist"):
        raise ValueError(
            f"{where}: field {config.images_key!r} must be a list of images, got {type(entries).__name__}"
        )
    images = []
    for number, entry in enumerate(list(entries)):
        entry_where = f"{where}: field {config.images_key!r} image {number}"
        try:
            raw = entry_bytes(entry, base_dir)
        except ImageError as error:
            raise ValueError(f"{entry_where}: {error}") from error
        images.append(decode_image(raw, config.max_image_pixels, "data.max_image_pixels", entry_where))
    return images


def expand_images(
    ids: list[int], mask: list[int], images: list, prompter: ImagePrompter, where: str
) -> tuple[list[int], list[int], ImageInputs]:
    """``ids`` and ``mask`` with each image placeholder repeated once per image token (the copies
    are prompt: mask 0), and the processed images (:meth:`ImagePrompter.process`: the
    processor's own refusals name ``where`` and the image)."""
    inputs = prompter.process(images, where=where)
    expanded = expand_image_tokens(ids, inputs, prompter.placeholder, prompter.merge)
    counts = iter(inputs.token_counts(prompter.merge))
    expanded_mask = []
    for token, keep in zip(ids, mask, strict=True):
        expanded_mask.extend([0] * next(counts) if token == prompter.placeholder else [keep])
    return expanded, expanded_mask, inputs


def tokenize_row(
    row: dict,
    config: SFTDataConfig,
    tokenizer: Any,
    prompter: ImagePrompter | None,
    base_dir: Path,
    where: str,
) -> tuple[list[int], list[int], ImageInputs | None] | None:
    """``(input_ids, loss_mask, images)`` of one file row as the data set keeps it (cut right by
    ``data.truncation=right``), or ``None`` when ``data.truncation=drop`` skips it; ``where``
    names the row in errors. The controller's load and a rank collating its own rows
    (:mod:`tandem.sft.dataset_rows`) both call it, so both see the same tokens."""
    if config.messages_key not in row:
        raise ValueError(f"{where}: missing field {config.messages_key!r} (has {sorted(row)})")
    pictures = row_images(row, config, base_dir, where)
    if pictures and prompter is None:
        raise ValueError(f"{where}: the row has images but the model has no vision tower")
    ids, mask = tokenize_conversation(
        tokenizer, row[config.messages_key], where, len(pictures), config.special_tokens_in_text
    )
    inputs = None
    if pictures:
        ids, mask, inputs = expand_images(
            ids, mask, pictures, prompter, f"{where}: field {config.images_key!r}"
        )
    if len(ids) <= config.max_length:
        return ids, mask, inputs
    if inputs is not None and config.truncation == "right":
        raise ValueError(
            f"{where}: {len(ids)} tokens exceed data.max_length={config.max_length}, and a row "
            "with images is never cut (raise data.max_length or set data.truncation=drop)"
        )
    if config.truncation == "error":
        raise ValueError(
            f"{where}: {len(ids)} tokens exceed data.max_length={config.max_length} "
            "(set data.truncation=right or drop)"
        )
    if config.truncation == "drop":
        return None
    return ids[: config.max_length], mask[: config.max_length], inputs


@dataclass
class SFTDataset:
    """Tokenised conversations: ``samples[i] = (input_ids, loss_mask)`` and ``images[i]`` (None: a
    text row); ``dropped`` counts over-long rows skipped. Per kept row, whatever ``samples``
    holds: ``rows[i]`` (its row number in the file), ``lengths[i]`` (its tokens) and
    ``loss_tokens[i]`` (its ``loss_mask`` tokens). Loaded with ``keep_tokens=False`` the set
    holds only those per-row ints (``samples`` and ``images`` empty): the controller's view when
    the ranks collate their own rows (:mod:`tandem.sft.dataset_rows`)."""

    samples: list[tuple[list[int], list[int]]]
    dropped: int = 0
    images: list[ImageInputs | None] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    loss_tokens: list[int] = field(default_factory=list)

    @staticmethod
    def load(
        path: str | Path,
        tokenizer: Any,
        config: SFTDataConfig,
        prompter: ImagePrompter | None = None,
        keep_tokens: bool = True,
    ) -> SFTDataset:
        """Read and tokenise ``path``; ``prompter`` (a vision-language model's) takes rows' images.
        ``keep_tokens=False``: keep only each row's number, length and loss-token count."""
        dataset = SFTDataset([])
        for index, row in enumerate(read_rows(path)):
            sample = tokenize_row(row, config, tokenizer, prompter, Path(path).parent, f"{path}: row {index}")
            if sample is None:
                dataset.dropped += 1
                continue
            ids, mask, inputs = sample
            dataset.rows.append(index)
            dataset.lengths.append(len(ids))
            dataset.loss_tokens.append(sum(mask))
            if keep_tokens:
                dataset.samples.append((ids, mask))
                dataset.images.append(inputs)
        if not dataset.rows:
            raise ValueError(f"{path}: no usable rows ({dataset.dropped} dropped as too long)")
        return dataset

    def __len__(self) -> int:
        return len(self.rows)

    def collate(self, indices: list[int], pad_id: int, width: int | None = None) -> Batch:
        """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` (``[B, S]``) of the given
        rows; ``S`` is ``width`` when given (a rank's share of a wider step), else the longest row."""
        rows = [self.samples[i] for i in indices]
        length = max(len(ids) for ids, _ in rows) if width is None else width
        input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), length), dtype=torch.long)
        loss_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for row, (ids, mask) in enumerate(rows):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            loss_mask[row, : len(mask)] = torch.tensor(mask)
        tensors = {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}
        images = [self.images[i] for i in indices] if self.images else []
        if any(image is not None for image in images):
            return Batch(tensors, non_tensors={"images": images})
        return Batch(tensors)
