"""``data.*``: where the prompts are and how they are cut."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.config.validation import check_choice, check_positive, check_range
from tandem.data.file_lists import file_list

OVERLONG_PROMPTS = ("filter", "error", "truncate_left", "truncate_right", "truncate_middle")


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
    """

    train_path: Any = ""  # str | list[str]: OmegaConf cannot type a union with a list
    val_path: Any = ""
    train_batch_size: int = 32
    max_prompt_length: int = 256
    overlong_prompts: str = "filter"
    shuffle: bool = True
    val_max_samples: int = 0

    def __post_init__(self) -> None:
        check_positive("data", "train_batch_size", self.train_batch_size)
        check_positive("data", "max_prompt_length", self.max_prompt_length)
        check_choice("data", "overlong_prompts", self.overlong_prompts, OVERLONG_PROMPTS)
        check_range("data", "val_max_samples", self.val_max_samples, low=0)
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
