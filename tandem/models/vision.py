"""Vision-language models (Qwen2-VL, Qwen2.5-VL): images become the language model's inputs.

A VLM prompt holds one ``<|image_pad|>`` token per merged block of each image (a 2x2 block of
14-pixel patches). The vision tower turns an image's patches into one embedding per such
token, and those embeddings replace the placeholder tokens' own embeddings before the
decoder runs. Positions are M-RoPE's: three rows (time, height, width) that count text tokens
as usual and lay an image's tokens out on its grid (:func:`mrope_positions`); after the last
image every row is the text position plus one per-sequence offset, ``delta``.

Everything here works on one sequence's images at a time (:class:`ImageInputs`), so packed
rows, rollout requests and sample stores carry images per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoImageProcessor

from tandem.protocol.images import ImageInputs


def is_vision_language(config) -> bool:
    """Whether a model config (or a model) is a vision-language model's."""
    config = getattr(config, "config", config)
    return getattr(config, "vision_config", None) is not None


def vision_language_model(model: nn.Module) -> nn.Module:
    """The inner model that holds the vision tower (``visual``), the language model and
    ``get_rope_index``, from a ``...ForConditionalGeneration`` (or a PEFT wrapper of one)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    inner = getattr(model, "model", model)
    if not hasattr(inner, "visual"):
        raise ValueError(f"{type(model).__name__} is not a vision-language model (it has no vision tower)")
    return inner


def image_token_id(config) -> int:
    """The id of the ``<|image_pad|>`` placeholder token."""
    config = getattr(config, "config", config)
    return int(config.image_token_id)


def merge_size(config) -> int:
    """How many patches per side merge into one image token (2 for the Qwen2-VL families)."""
    config = getattr(config, "config", config)
    return int(config.vision_config.spatial_merge_size)


def expand_image_tokens(
    token_ids: Sequence[int], images: ImageInputs, placeholder: int, merge: int
) -> list[int]:
    """``token_ids`` with each single ``placeholder`` (one per image, as a chat template writes
    it) repeated as many times as its image has tokens; raises when the counts differ."""
    counts = images.token_counts(merge)
    found = sum(1 for token in token_ids if token == placeholder)
    if found != len(counts):
        raise ValueError(
            f"the prompt has {found} image placeholder{'s' * (found != 1)} and {len(counts)} "
            f"image{'s' * (len(counts) != 1)}: each image needs exactly one placeholder"
        )
    expanded: list[int] = []
    sizes = iter(counts)
    for token in token_ids:
        expanded.extend([token] * next(sizes) if token == placeholder else [token])
    return expanded


def image_features(model: nn.Module, images: ImageInputs) -> torch.Tensor:
    """The vision tower's output for ``images``: ``[N, H]``, one embedding per image token, image
    after image (``N = sum(token_counts)``, ``H`` the language model's width)."""
    inner = vision_language_model(model)
    visual = inner.visual
    pixels = images.pixel_values.to(device=next(visual.parameters()).device, dtype=visual.dtype)
    grid = images.image_grid_thw.to(pixels.device)
    return visual(pixels, grid_thw=grid).pooler_output


def image_token_mask(
    token_ids: torch.Tensor, images: ImageInputs | None, placeholder: int, merge: int
) -> torch.Tensor:
    """``[L]`` bool: which tokens of one sequence ``token_ids [L]`` stand for its images — the
    first ``sum(token_counts)`` placeholder tokens. A placeholder id after them (a response
    may sample the token like any other) is an ordinary token."""
    placeholders = token_ids == placeholder
    wanted = sum(images.token_counts(merge)) if images is not None else 0
    return placeholders & (placeholders.cumsum(-1) <= wanted)


def embed_with_images(
    model: nn.Module, input_ids: torch.Tensor, features: torch.Tensor | None, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Token embeddings ``[B, S, H]`` of ``input_ids [B, S]`` with the rows of the image tokens
    (``mask [B, S]``, default: every placeholder token; see :func:`image_token_mask`) replaced, in
    order, by ``features [N, H]`` (:func:`image_features`); raises when ``N`` is not the number of
    image tokens."""
    inner = vision_language_model(model)
    embeds = inner.get_input_embeddings()(input_ids)
    if mask is None:
        mask = input_ids == image_token_id(inner.config)
    count = int(mask.sum())
    given = 0 if features is None else int(features.shape[0])
    if count != given:
        raise ValueError(f"the tokens hold {count} image placeholders but the images give {given} embeddings")
    if features is None:
        return embeds
    return embeds.masked_scatter(mask.unsqueeze(-1), features.to(embeds.dtype))


def mrope_positions(
    model: nn.Module, token_ids: torch.Tensor, images: ImageInputs | None
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions ``[3, L]`` of one sequence ``token_ids [L]`` (no padding) and its offset
    ``delta``: a token ``j`` after the last image sits at ``j + delta`` in every row, so a
    decoded token at text position ``p`` has position ``p + delta``. Without images the three
    rows are ``0 .. L-1`` and ``delta`` is 0. A placeholder token after the images' own
    (:func:`image_token_mask`) counts as text."""
    length = int(token_ids.shape[0])
    if images is None or images.num_images == 0:
        return torch.arange(length, device=token_ids.device).expand(3, length).clone(), 0
    inner = vision_language_model(model)
    ids = token_ids.unsqueeze(0)
    token_types = image_token_mask(ids, images, image_token_id(inner.config), merge_size(inner.config)).to(
        torch.int32
    )
    positions, deltas = inner.get_rope_index(
        ids, mm_token_type_ids=token_types, image_grid_thw=images.image_grid_thw.to(ids.device)
    )
    return positions[:, 0], int(deltas.flatten()[0])


def load_image_processor(path: str | Path, min_pixels: int | None = None, max_pixels: int | None = None):
    """The image processor saved in the model directory ``path`` (``AutoImageProcessor``), with
    its resizing bounds replaced where given (``data.image.min_pixels`` / ``max_pixels``)."""
    if not (Path(path) / "preprocessor_config.json").exists():
        raise FileNotFoundError(
            f"no image processor at {path}: preprocessor_config.json is missing (a vision-language model "
            f"directory saves its processor with save_pretrained)"
        )
    processor = AutoImageProcessor.from_pretrained(str(path))
    if min_pixels is None and max_pixels is None:
        return processor
    size = {
        "shortest_edge": processor.size["shortest_edge"] if min_pixels is None else min_pixels,
        "longest_edge": processor.size["longest_edge"] if max_pixels is None else max_pixels,
    }
    if size["shortest_edge"] > size["longest_edge"]:
        raise ValueError(
            f"data.image.min_pixels={size['shortest_edge']} exceeds data.image.max_pixels={size['longest_edge']}"
        )
    return AutoImageProcessor.from_pretrained(str(path), size=size)


def process_images(processor, images: Sequence) -> ImageInputs:
    """``images`` (PIL images) through the model's image processor -> :class:`ImageInputs`."""
    out = processor(images=list(images), return_tensors="pt")
    return ImageInputs(out["pixel_values"].float(), out["image_grid_thw"].long())


@dataclass(frozen=True)
class ImagePrompter:
    """Images for one VLM, the one reader every caller shares: the model's image processor,
    placeholder token and merge size.

    :meth:`process` turns PIL images into :class:`ImageInputs`, each image under its own pixel
    bounds where it has them (a data file's entry may set ``min_pixels`` / ``max_pixels``).
    :meth:`prompt` takes token ids rendered by the chat template (one placeholder per image)
    and the images, and returns the ids with each placeholder expanded and the processed
    :class:`ImageInputs` that go with them. Build one with :meth:`for_model`.
    """

    processor: Any
    placeholder: int
    merge: int
    model_path: str = ""
    min_pixels: int | None = None
    max_pixels: int | None = None
    _bounded: dict[tuple[int | None, int | None], Any] = field(
        default_factory=dict, compare=False, repr=False
    )

    @staticmethod
    def for_model(
        path: str | Path, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> ImagePrompter | None:
        """The prompter of the model directory ``path``; None when the model has no vision tower.
        Its image processor is loaded here, so a missing ``preprocessor_config.json`` fails early."""
        config = AutoConfig.from_pretrained(str(path))
        if not is_vision_language(config):
            return None
        processor = load_image_processor(path, min_pixels, max_pixels)
        return ImagePrompter(
            processor, image_token_id(config), merge_size(config), str(path), min_pixels, max_pixels
        )

    def processor_for(self, bounds: tuple[int | None, int | None] = (None, None)) -> Any:
        """The image processor for an image with its own ``(min_pixels, max_pixels)`` (None: the
        prompter's); each distinct pair is loaded once."""
        low = self.min_pixels if bounds[0] is None else bounds[0]
        high = self.max_pixels if bounds[1] is None else bounds[1]
        if (low, high) == (self.min_pixels, self.max_pixels):
            return self.processor
        if (low, high) not in self._bounded:
            self._bounded[(low, high)] = load_image_processor(self.model_path, low, high)
        return self._bounded[(low, high)]

    def process(
        self,
        images: Sequence,
        bounds: Sequence[tuple[int | None, int | None]] | None = None,
        where: str = "images",
    ) -> ImageInputs:
        """PIL ``images`` as one :class:`ImageInputs` (``pixel_values [P, D]``, ``image_grid_thw
        [I, 3]``), image ``i`` under ``bounds[i]`` (None: the prompter's bounds for all).

        Each image is processed alone (the same pixels and grid as together), so the processor's
        own refusals (Qwen2-VL's aspect ratio under 200) raise ``ValueError`` naming ``where``,
        the image's number and its size.
        """
        bounds = [(None, None)] * len(images) if bounds is None else list(bounds)
        parts = []
        for number, (image, bound) in enumerate(zip(images, bounds, strict=True)):
            try:
                parts.append(process_images(self.processor_for(bound), [image]))
            except ValueError as error:
                raise ValueError(f"{where} image {number} ({image.width}x{image.height}): {error}") from None
        return ImageInputs.concat(parts)

    def prompt(self, token_ids: Sequence[int], images: Sequence) -> tuple[list[int], ImageInputs | None]:
        """``(expanded ids, images)`` for PIL ``images`` (``(ids, None)`` when there are none, after
        checking the ids hold no placeholder)."""
        if not images:
            expand_image_tokens(
                token_ids, NO_IMAGES, self.placeholder, self.merge
            )  # raises on a stray placeholder
            return list(token_ids), None
        inputs = process_images(self.processor, images)
        return expand_image_tokens(token_ids, inputs, self.placeholder, self.merge), inputs


NO_IMAGES = ImageInputs(torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long))
