"""The RL prompt dataset: parquet (or JSONL) rows in verl's schema, tokenised with the chat template.

A row holds ``data_source`` (str: selects the reward function), ``prompt`` (chat messages:
a list of ``{"role", "content"}`` dicts), ``reward_model`` (a dict with ``ground_truth``),
and optionally ``ability`` (str) and ``extra_info`` (dict). verl users' files load unchanged.
A malformed row is an error naming the file, the row and the field. For a vision-language
model a row may also hold images (verl's ``images`` column and ``<image>`` placeholders:
:mod:`tandem.rl.data.images`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tandem.data.file_lists import file_list
from tandem.data.rows import read_rows
from tandem.models.chat import check_message, template_ids, with_image_parts
from tandem.models.vision import ImagePrompter
from tandem.protocol import Batch
from tandem.protocol.fields import PROMPT_IMAGES, PROMPT_PLACE, PROMPT_SOURCE
from tandem.protocol.images import ImageInputs
from tandem.rl.config.data import RLImageConfig
from tandem.rl.data.images import ImageReader, PromptImages, expand_prompt, row_images


@dataclass(frozen=True)
class PromptSample:
    """One tokenised prompt and what its reward function needs.

    ``images`` holds a vision-language prompt's images, encoded (:class:`PromptImages`; None:
    text only); ``prompt_ids`` then already holds one ``<|image_pad|>`` per image token.
    ``raw_prompt`` is the row's messages as the file holds them, ``<image>`` placeholders included.
    """

    prompt_ids: tuple[int, ...]
    data_source: str
    ground_truth: str
    extra_info: dict
    raw_prompt: list
    agent_name: str = ""  # the row's agent loop (empty: agent.name)
    images: PromptImages | None = None


# PROMPT_PLACE's (file, row): the file's number in PromptSource.files and the row's in that file, as
# read (filtered rows counted); PROMPT_SOURCE: the PromptSource.key those places refer to
REBUILT = ("prompt_ids", "raw_prompt", "images")  # what a request by place leaves to the worker to build


REQUIRED = {  # what each required field must hold, for the messages
    "data_source": "it must be a string naming the reward scorer",
    "prompt": "it must be a non-empty list of chat messages",
    "reward_model": "it must be a dict with 'ground_truth'",
}


def validate_row(row: Any, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` and the field when ``row`` does not follow verl's schema."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a mapping of fields, got {type(row).__name__}")
    for name in ("data_source", "prompt", "reward_model"):
        if name not in row:
            raise ValueError(f"{where}: missing field {name!r} (has {sorted(row)})")
        if row[name] is None:
            raise ValueError(f"{where}: field {name!r} is null; {REQUIRED[name]}")
    if not isinstance(row["data_source"], str):
        raise ValueError(
            f"{where}: field 'data_source' must be a string, got {type(row['data_source']).__name__}"
        )
    prompt = row["prompt"]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(
            f"{where}: field 'prompt' must be a non-empty list of chat messages, got {type(prompt).__name__}"
        )
    for turn, message in enumerate(prompt):
        check_message(message, f"{where}: field 'prompt' message {turn}")
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise ValueError(
            f"{where}: field 'reward_model' must be a dict with 'ground_truth', got {reward_model!r}"
        )
    truth = reward_model["ground_truth"]
    if not isinstance(truth, (str, int, float)) or isinstance(truth, bool):
        raise ValueError(
            f"{where}: field 'reward_model.ground_truth' must be a string or number, got {type(truth).__name__}"
        )
    if row.get("ability") is not None and not isinstance(row["ability"], str):
        raise ValueError(f"{where}: field 'ability' must be a string, got {type(row['ability']).__name__}")
    if row.get("extra_info") is not None and not isinstance(row["extra_info"], dict):
        raise ValueError(
            f"{where}: field 'extra_info' must be a dict, got {type(row['extra_info']).__name__}"
        )


def truncate(ids: list[int], length: int, how: str) -> list[int]:
    """``ids`` cut to ``length`` tokens: ``truncate_left`` keeps the end, ``truncate_right`` the
    start, ``truncate_middle`` the first ``length // 2`` and the last ``length - length // 2``."""
    if how == "truncate_left":
        return ids[-length:]
    if how == "truncate_right":
        return ids[:length]
    if how == "truncate_middle":
        head = length // 2
        return ids[:head] + ids[len(ids) - (length - head) :]
    raise ValueError(f"data.overlong_prompts={how!r} is not a truncation")


DataFiles = str | Path | Sequence[str | Path]


def as_files(paths: DataFiles) -> tuple[Path, ...]:
    """``paths`` — one file, or a list of files as in verl's ``data.train_files`` — as a tuple
    (:func:`tandem.data.file_list`); ``ValueError`` when that names no file."""
    files = file_list(paths, "data files")
    if not files:
        raise ValueError("no data files given (an empty path or list)")
    return tuple(Path(path) for path in files)


@dataclass(frozen=True)
class PromptSource:
    """How :meth:`RLDataset.load` read and tokenised its prompts: the files in order and the settings
    it was given; a worker rebuilding a row from its place uses the same
    (:mod:`tandem.rl.data.prompt_rows`)."""

    files: tuple[str, ...]
    max_prompt_length: int
    overlong: str
    special_tokens_in_text: str
    image: RLImageConfig = field(default_factory=RLImageConfig)  # data.image.*: how images are read
    image_key: str = "images"  # data.image_key
    video_key: str = "videos"  # data.video_key

    @staticmethod
    def of(
        paths: DataFiles,
        max_prompt_length: int,
        overlong: str,
        special_tokens_in_text: str,
        image: RLImageConfig | None = None,
        image_key: str = "images",
        video_key: str = "videos",
    ) -> PromptSource:
        """The source of ``paths`` (:func:`as_files`) read with these settings (``image``: the
        defaults when None)."""
        files = tuple(str(path) for path in as_files(paths))
        return PromptSource(
            files, max_prompt_length, overlong, special_tokens_in_text, image or RLImageConfig(),
            image_key, video_key,
        )  # fmt: skip

    def image_reader(self, prompter: ImagePrompter | None) -> ImageReader:
        """The reader of this source's rows' images, processing them with ``prompter`` (the run's
        model's; None for a model without a vision tower)."""
        model_path = prompter.model_path if prompter is not None else ""
        return ImageReader(model_path, self.image, self.image_key, self.video_key, prompter)

    @property
    def key(self) -> str:
        """A short name of this source (a hash of its fields): what a request's meta carries."""
        return hashlib.sha256(repr(dataclasses.astuple(self)).encode()).hexdigest()[:16]


def prompt_sample(
    row: Any,
    where: str,
    tokenizer: Any,
    max_prompt_length: int,
    overlong: str,
    reader: ImageReader,
    folder: Path,
    special_tokens_in_text: str = "text",
) -> PromptSample | None:
    """One validated, tokenised row; ``None`` when ``overlong=filter`` drops it (what :meth:`RLDataset.load`
    makes of each row, and a rank of a request's rows: :mod:`tandem.rl.data.prompt_rows`)."""
    validate_row(row, where)
    images = row_images(row, where, folder, reader)
    messages = row["prompt"] if images is None else with_image_parts(row["prompt"])[0]
    try:
        ids = template_ids(
            tokenizer, messages, add_generation_prompt=True, special_tokens_in_text=special_tokens_in_text
        )
    except ValueError as error:  # a typed special token the template's rewriting hides: name the row
        raise ValueError(f"{where}: {error}") from error
    if images is not None:
        ids = expand_prompt(ids, images, reader, where)
    if len(ids) > max_prompt_length:
        if overlong == "error":
            raise ValueError(
                f"{where}: field 'prompt' is {len(ids)} tokens, over data.max_prompt_length="
                f"{max_prompt_length} (raise it, or set data.overlong_prompts=filter)"
            )
        if overlong == "filter":
            return None
        if images is not None:
            raise ValueError(
                f"{where}: field 'prompt' is {len(ids)} tokens with its image tokens, over "
                f"data.max_prompt_length={max_prompt_length}, and cutting it would cut image tokens "
                f"(data.overlong_prompts={overlong}); raise the limit, lower data.image.max_pixels, "
                "or set data.overlong_prompts=filter"
            )
        ids = truncate(ids, max_prompt_length, overlong)
    return PromptSample(
        prompt_ids=tuple(ids),
        data_source=row["data_source"],
        ground_truth=str(row["reward_model"]["ground_truth"]),
        extra_info=dict(row.get("extra_info") or {}),
        raw_prompt=list(row["prompt"]),
        agent_name=str(row.get("agent_name") or ""),
        images=images,
    )


@dataclass
class RLDataset:
    """Tokenised prompts; ``filtered`` counts the prompts dropped as longer than ``max_prompt_length``;
    ``reader`` processes the prompts' images when a batch is built; ``positions`` holds each sample's
    ``(file, row)``: the file's number in ``source.files`` and the row's in that file (set by
    :meth:`load`, with ``source``)."""

    samples: list[PromptSample]
    filtered: int = 0
    reader: ImageReader | None = None
    positions: list[tuple[int, int]] = field(default_factory=list)
    source: PromptSource | None = None

    @staticmethod
    def load(
        paths: DataFiles,
        tokenizer: Any,
        max_prompt_length: int,
        overlong: str = "filter",
        images: ImageReader | None = None,
        special_tokens_in_text: str = "text",
    ) -> RLDataset:
        """Read and tokenise ``paths``: one file, or several read in order as one dataset (verl
        concatenates the files of ``data.train_files`` the same way), every row checked against
        verl's schema with errors naming its file and row. ``overlong`` is ``filter`` (drop and
        count), ``error``, or ``truncate_left`` / ``truncate_right`` / ``truncate_middle`` (cut
        to ``max_prompt_length``). ``images`` reads rows' images for the model
        (:func:`tandem.rl.data.images.image_reader`); without it a row holding images is an error.
        ``special_tokens_in_text`` is ``data.special_tokens_in_text`` (:func:`~tandem.models.chat.template_ids`)."""
        reader = images or ImageReader(model_path="")
        files = as_files(paths)
        samples, filtered, positions = [], 0, []
        for number, path in enumerate(files):
            rows = read_rows(path)
            if not rows:
                raise ValueError(f"data file {path} has no rows")
            for index, row in enumerate(rows):
                where = f"{path}: row {index}"
                sample = prompt_sample(
                    row,
                    where,
                    tokenizer,
                    max_prompt_length,
                    overlong,
                    reader,
                    path.parent,
                    special_tokens_in_text,
                )
                if sample is None:
                    filtered += 1
                else:
                    samples.append(sample)
                    positions.append((number, index))
        if not samples:
            names = ", ".join(str(path) for path in files)
            raise ValueError(
                f"{names}: no usable prompts ({filtered} longer than {max_prompt_length} tokens)"
            )
        source = PromptSource.of(
            files, max_prompt_length, overlong, special_tokens_in_text, reader.settings,
            reader.image_key, reader.video_key,
        )  # fmt: skip
        return RLDataset(samples, filtered, reader, positions, source)

    def check_fills_batch(self, batch_size: int, field: str) -> None:
        """Raise ``ValueError`` with the numbers when there are fewer prompts than one batch:
        every step would then sample some prompts several times into the same batch (a
        1-prompt file and ``train_batch_size=64`` gave 64 copies of that prompt per step)."""
        if len(self) >= batch_size:
            return
        dropped = f" ({self.filtered} dropped as longer than data.max_prompt_length)" if self.filtered else ""
        raise ValueError(
            f"{field} has {len(self)} usable prompts{dropped}, fewer than data.train_batch_size="
            f"{batch_size}: every step would repeat prompts within its batch; lower "
            "data.train_batch_size or add prompts"
        )

    def __len__(self) -> int:
        return len(self.samples)

    @cached_property
    def has_images(self) -> bool:
        """Whether any prompt holds images (then batches carry the ``images`` column)."""
        return any(sample.images is not None for sample in self.samples)

    def image_inputs(self, sample: PromptSample) -> ImageInputs | None:
        """``sample``'s images processed for the model (None: a text-only prompt)."""
        if sample.images is None:
            return None
        assert self.reader is not None, "a dataset with images is loaded with its reader"
        return self.reader.inputs(sample.images)

    def collate(self, indices: list[int]) -> Batch:
        """The prompts at ``indices`` as a batch of per-sample columns (token ids stay lists until
        generation); a dataset with images adds ``images``, one :class:`ImageInputs` or None a row."""
        return Batch(non_tensors=self._columns(indices, rebuilt=True))

    def _columns(self, indices: list[int], rebuilt: bool) -> dict[str, list]:
        """:meth:`collate`'s columns of the rows at ``indices``, in its order; without ``rebuilt``
        not the ones a request by place leaves to the worker (:data:`REBUILT`, never computed)."""
        rows = [self.samples[i] for i in indices]
        columns: dict[str, Any] = {
            "prompt_ids": lambda: [r.prompt_ids for r in rows],
            "data_source": lambda: [r.data_source for r in rows],
            "ground_truth": lambda: [r.ground_truth for r in rows],
            "extra_info": lambda: [r.extra_info for r in rows],
            "raw_prompt": lambda: [r.raw_prompt for r in rows],
            "agent_name": lambda: [r.agent_name for r in rows],
            "index": lambda: list(indices),
        }
        if self.has_images:
            columns["images"] = lambda: [self.image_inputs(r) for r in rows]
        return {name: make() for name, make in columns.items() if rebuilt or name not in REBUILT}

    def requests(self, indices: list[int]) -> Batch:
        """The rows at ``indices`` as a generation request naming each row's place, not its tokens:
        :meth:`collate`'s columns but ``prompt_ids``, ``raw_prompt`` and ``images``
        (:data:`REBUILT`), with ``prompt_place`` (:data:`PROMPT_PLACE`: ``(file, row)`` a row) and
        ``source.key`` in the meta (:data:`PROMPT_SOURCE`); the worker reads and tokenises those rows
        as :meth:`load` did (:class:`tandem.rl.data.prompt_rows.RankPrompts`), a dataset with images
        processing the rows' images there too (the meta's :data:`PROMPT_IMAGES` says so: ``images``
        is then a column of every request, as in :meth:`collate`). A dataset not built by
        :meth:`load` gives :meth:`collate`'s request (its rows hold their prompt ids and images)."""
        if self.source is None:
            return self.collate(indices)
        columns = {**self._columns(indices, rebuilt=False), PROMPT_PLACE: [self.positions[i] for i in indices]}
        meta = {PROMPT_SOURCE: self.source.key, PROMPT_IMAGES: self.has_images}
        return Batch(non_tensors=columns, meta=meta)
