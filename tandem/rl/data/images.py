"""Images in verl-schema prompts: read, check and turn into a vision-language model's inputs.

A row may carry its images in the ``data.image_key`` column (``images``, as in verl): a list of
``{"bytes": <png/jpeg bytes>}`` or ``{"path": "<file>"}`` entries (a relative path is relative to
the data file's folder), and its prompt holds one ``<image>`` per image, in order. An entry may
also set its own ``min_pixels`` / ``max_pixels``, which replace ``data.image.*`` for that image.

At load time each image is decoded and processed once, to check it and to count its image
tokens (the prompt's ``<|image_pad|>`` placeholders are expanded, so ``data.max_prompt_length``
applies to the length the model sees). A sample keeps only the encoded image
(:class:`PromptImages`); :meth:`ImageReader.inputs` processes it again when a batch is built,
since processed pixels take ~300x the memory of a PNG. Decoding is
:func:`tandem.data.images.decode_image` and processing the model's
:class:`~tandem.models.vision.ImagePrompter`, as for every other reader of images.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.data.images import ImageError, decode_image, entry_bytes
from tandem.models.chat import IMAGE_PLACEHOLDER
from tandem.models.vision import ImagePrompter, expand_image_tokens
from tandem.protocol.images import ImageInputs
from tandem.rl.config.data import RLDataConfig, RLImageConfig

ENTRY_KEYS = ("bytes", "path", "min_pixels", "max_pixels")


@dataclass(frozen=True)
class PromptImages:
    """One prompt's images as the data file holds them, and the grid each was processed to.

    Attributes:
        encoded: each image's file bytes (PNG, JPEG, ...), in placeholder order.
        pixel_bounds: each image's own ``(min_pixels, max_pixels)`` (None: ``data.image.*``).
        image_grid_thw: ``[I, 3]`` int64, each image's patch grid (what its token count follows).
    """

    encoded: tuple[bytes, ...]
    pixel_bounds: tuple[tuple[int | None, int | None], ...]
    image_grid_thw: torch.Tensor

    @property
    def num_images(self) -> int:
        return len(self.encoded)


@dataclass
class ImageReader:
    """Where a data file's rows hold their images (``data.image_key``, ``data.video_key``), the
    limits they are read under (``data.image.*``) and the model's
    :class:`~tandem.models.vision.ImagePrompter`, which processes them (see the module docstring).

    ``prompter`` is None for a model without a vision tower: its rows may not hold images.
    Build one with :func:`image_reader`.
    """

    model_path: str
    settings: RLImageConfig = field(default_factory=RLImageConfig)
    image_key: str = "images"
    video_key: str = "videos"
    prompter: ImagePrompter | None = None

    def decode(self, data: bytes, where: str):
        """An image file's bytes as an RGB image (:func:`tandem.data.images.decode_image`, under
        ``data.image.max_image_pixels``); ``ValueError`` naming ``where``."""
        return decode_image(data, self.settings.max_image_pixels, "data.image.max_image_pixels", where)

    def inputs(self, images: PromptImages | None) -> ImageInputs | None:
        """``images`` processed into the model's inputs (None stays None: a text-only prompt)."""
        if images is None:
            return None
        assert self.prompter is not None, "a row with images was read with the model's prompter"
        pictures = [
            self.decode(data, f"a prompt's image {number}") for number, data in enumerate(images.encoded)
        ]
        return self.prompter.process(pictures, images.pixel_bounds, "a prompt's")


def image_reader(model_path: str, data: RLDataConfig) -> ImageReader:
    """The reader of ``data``'s images for the model in ``model_path``; a vision-language model's
    image processor is loaded here, once, so a missing ``preprocessor_config.json`` fails early."""
    prompter = ImagePrompter.for_model(model_path, data.image.min_pixels, data.image.max_pixels)
    return ImageReader(str(model_path), data.image, data.image_key, data.video_key, prompter)


def count_placeholders(messages: list[dict]) -> int:
    return sum(message["content"].count(IMAGE_PLACEHOLDER) for message in messages)


def row_images(row: dict, where: str, folder: Path, reader: ImageReader) -> PromptImages | None:
    """The images of a validated ``row`` (``where`` names its file and row in errors; ``folder``
    is the data file's, for relative paths), checked against its ``<image>`` placeholders and
    processed once for their grids; None for a row without images."""
    videos = row.get(reader.video_key)
    if videos is not None and len(_entry_list(videos, f"{where}: field {reader.video_key!r}")):
        raise ValueError(
            f"{where}: field {reader.video_key!r} holds videos; tandem reads images only (videos are not "
            f"supported yet): drop the column or empty it"
        )
    if reader.image_key not in row:
        return None
    field_where = f"{where}: field {reader.image_key!r}"
    entries = _entry_list(row[reader.image_key], field_where)
    placeholders = count_placeholders(row["prompt"])
    if placeholders != len(entries):
        raise ValueError(
            f"{where}: field 'prompt' has {placeholders} {IMAGE_PLACEHOLDER} placeholder"
            f"{'s' * (placeholders != 1)} but field {reader.image_key!r} has {len(entries)} image"
            f"{'s' * (len(entries) != 1)}: each image needs exactly one placeholder, in order"
        )
    if not entries:
        return None
    if reader.prompter is None:
        raise ValueError(
            f"{field_where} holds {len(entries)} image{'s' * (len(entries) != 1)}, but the model "
            f"{reader.model_path or '(none given)'} has no vision tower: train a vision-language model "
            "(Qwen2-VL, Qwen2.5-VL) on images"
        )
    encoded, bounds, pictures = [], [], []
    for number, entry in enumerate(entries):
        entry_where = f"{field_where} image {number}"
        data, pixel_bounds = _read_entry(entry, entry_where, folder)
        pictures.append(reader.decode(data, entry_where))
        try:
            reader.prompter.processor_for(pixel_bounds)  # an entry's bounds the processor refuses
        except ValueError as error:
            raise ValueError(f"{entry_where}: {error}") from None
        encoded.append(data)
        bounds.append(pixel_bounds)
    grids = reader.prompter.process(pictures, bounds, field_where).image_grid_thw
    return PromptImages(tuple(encoded), tuple(bounds), grids)


def expand_prompt(ids: list[int], images: PromptImages, reader: ImageReader, where: str) -> list[int]:
    """The template's ``ids`` with each image's one ``<|image_pad|>`` repeated once per image token."""
    grid_only = ImageInputs(torch.empty(0), images.image_grid_thw)
    try:
        return expand_image_tokens(ids, grid_only, reader.prompter.placeholder, reader.prompter.merge)
    except ValueError as error:
        raise ValueError(
            f"{where}: the chat template of {reader.model_path} rendered the prompt with a different "
            f"number of image tokens than images ({error})"
        ) from None


def _entry_list(value: Any, where: str) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where} must be a list of image entries, got {type(value).__name__}")
    return list(value)


def _read_entry(entry: Any, where: str, folder: Path) -> tuple[bytes, tuple[int | None, int | None]]:
    """An image entry's file bytes and its own ``(min_pixels, max_pixels)``."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a dict with 'bytes' or 'path', got {type(entry).__name__}")
    given = {key for key, value in entry.items() if value is not None}
    unknown = sorted(given - set(ENTRY_KEYS))
    if unknown:
        raise ValueError(
            f"{where} has keys {unknown} tandem does not read; an entry holds {', '.join(ENTRY_KEYS)}"
        )
    bounds = tuple(_pixel_bound(entry, key, where) for key in ("min_pixels", "max_pixels"))
    try:
        return entry_bytes(entry, folder), bounds
    except ImageError as error:
        raise ValueError(f"{where}: {error}") from None


def _pixel_bound(entry: dict, key: str, where: str) -> int | None:
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: {key!r} must be a positive integer, got {value!r}")
    return value
