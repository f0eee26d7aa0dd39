"""``data.*``: where the prompts are and how they are cut."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.config.paths import INPUT_PATH, path_field
from tandem.config.validation import check_choice, check_positive, check_range
from tandem.data.file_lists import file_list
from tandem.models.chat_literal import SPECIAL_TOKENS_IN_TEXT

OVERLONG_PROMPTS = ("filter", "error", "truncate_left", "truncate_right", "truncate_middle")
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096


@dataclass(frozen=True)
class RLImageConfig:
    """How prompts' images are read (``data.image.*``), for a vision-language model (docs/multimodal.md).

    Attributes:
        min_pixels / max_pixels: bounds on an image's area after the image processor resizes
            it (in 28-pixel steps; each 28x28 block is one image token). None: the values
            saved in the model directory's ``preprocessor_config.json``. An image entry's own
            ``min_pixels`` / ``max_pixels`` replace these for that image, as in verl.
        max_image_pixels: the largest image accepted, in pixels (width x height of the file as
            decoded, before any resizing); a larger one is an error naming its row.
    """

    min_pixels: int | None = None
    max_pixels: int | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels"):
            if getattr(self, name) is not None:
                check_positive("data.image", name, getattr(self, name))
        check_positive("data.image", "max_image_pixels", self.max_image_pixels)
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(
                f"data.image.min_pixels={self.min_pixels} exceeds data.image.max_pixels={self.max_pixels}"
            )


@dataclass(frozen=True)
class RLDataConfig:
    """Prompts (``data.*``): parquet or JSONL files in verl's schema (see :mod:`tandem.rl.data`).

    Attributes:
        train_path / val_path: a parquet or JSONL file, or a list of them read in order as one
            dataset (verl's ``data.train_files=[gsm8k.parquet,math.parquet]``); ``val_path``
            empty: no validation. ``train_files`` / ``val_files`` give either as a tuple.
        train_batch_size: prompts per step.
        max_prompt_length: longest tokenised prompt (chat template applied).
        overlong_prompts: ``filter`` (drop them, counted and reported), ``error``, or cut them
            to ``max_prompt_length`` tokens: ``truncate_left`` (keep the end), ``truncate_right``
            (keep the start), ``truncate_middle`` (keep both ends).
        shuffle: a fresh seeded order each epoch.
        val_max_samples: evaluate on at most this many validation prompts (0: all).
        image_key: the column of a row's images (verl's ``data.image_key``): a list of
            ``{"bytes": ...}`` or ``{"path": ...}`` entries, one per ``<image>`` in the prompt.
        video_key: the column of a row's videos (verl's ``data.video_key``); videos are not
            supported yet, so a row with any is an error.
        image: how images are read and resized (:class:`RLImageConfig`).
        special_tokens_in_text: ``text`` (a special-token string inside a prompt's message, such
            as ``<|im_end|>``, is tokenized as plain text) or ``control`` (it becomes that control
            token, as transformers' ``apply_chat_template`` and vLLM do).
    """

    train_path: Any = path_field(INPUT_PATH)  # str | list[str]: OmegaConf cannot type a union with a list
    val_path: Any = path_field(INPUT_PATH)
    train_batch_size: int = 32
    max_prompt_length: int = 256
    overlong_prompts: str = "filter"
    shuffle: bool = True
    val_max_samples: int = 0
    image_key: str = "images"
    video_key: str = "videos"
    image: RLImageConfig = field(default_factory=RLImageConfig)
    special_tokens_in_text: str = "text"

    def __post_init__(self) -> None:
        check_choice("data", "special_tokens_in_text", self.special_tokens_in_text, SPECIAL_TOKENS_IN_TEXT)
        check_positive("data", "train_batch_size", self.train_batch_size)
        check_positive("data", "max_prompt_length", self.max_prompt_length)
        check_choice("data", "overlong_prompts", self.overlong_prompts, OVERLONG_PROMPTS)
        check_range("data", "val_max_samples", self.val_max_samples, low=0)
        for name in ("image_key", "video_key"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(
                    f"data.{name}={getattr(self, name)!r} must name a column (a non-empty string)"
                )
        if self.image_key == self.video_key:
            raise ValueError(
                f"data.image_key and data.video_key are both {self.image_key!r}: images and videos need "
                "their own columns"
            )
        file_list(self.train_path, "data.train_path")
        file_list(self.val_path, "data.val_path")

    @property
    def train_files(self) -> tuple[str, ...]:
        """The training files, in order (one or several)."""
        return file_list(self.train_path, "data.train_path")

    @property
    def val_files(self) -> tuple[str, ...]:
        """The validation files, in order (none when ``val_path`` is empty)."""
        return file_list(self.val_path, "data.val_path")
