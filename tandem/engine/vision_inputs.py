"""A vision-language model's forward inputs for a micro-batch: its images in token order and
its M-RoPE positions, laid out like the padded or packed tokens.

A batch row's images (the ``images`` field: one :class:`~tandem.protocol.images.ImageInputs`
per row, ``None`` for a text-only row) belong to the ``<|image_pad|>`` tokens of that row's
prompt (a stored draw's rank gets the field rebuilt from the block's tensor columns, laid out by
:func:`stored_image_layout`: :mod:`tandem.dataplane.images`). The engine keeps its 1-D positions for everything that is not the decoder's rotary
embedding (which token predicts which, packing, shared prompts) and hands the model a
:class:`VisionInputs` beside them: every image whose placeholders the forward's tokens hold,
in the order those placeholders appear, and the ``[3, B, S]`` M-RoPE positions
(:func:`tandem.models.vision.mrope_positions`), computed per row over its valid tokens and
then copied to wherever packing puts each token (fillers at 0).

The vision tower runs inside the wrapped module's forward (:func:`decoder_inputs`), so
data-parallel hooks and gradients reach it. It runs in every forward of a vision-language
model, on a blank one-token image when the micro-batch has none: under FSDP2 every rank must
gather the same units in the same order, and under DDP every trainable parameter must get a
gradient in every step. The blank image's features enter the embeddings times zero, so a
text-only forward computes exactly what it did before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig

from tandem.dataplane.images import ImageLayout
from tandem.device import to_device
from tandem.engine.packing import PackedSequences
from tandem.models.vision import (
    embed_with_images,
    image_features,
    image_token_id,
    image_token_mask,
    is_vision_language,
    merge_size,
    mrope_positions,
    vision_language_model,
)
from tandem.protocol.images import IMAGES_FIELD, ImageInputs


@dataclass(frozen=True)
class VisionInputs:
    """What a vision-language model's forward needs beside its tokens.

    Attributes:
        images: every image whose tokens the forward's ``input_ids [B, S]`` hold, in the order
            those tokens appear (row after row); ``None``: no image.
        rope_positions: ``[3, B, S]`` M-RoPE positions (time, height, width) of the tokens.
        image_mask: ``[B, S]`` bool, the tokens that stand for the images: each row's first
            placeholder tokens, as many as its images take (a placeholder id a response sampled
            is an ordinary token: :func:`tandem.models.vision.image_token_mask`).
    """

    images: ImageInputs | None
    rope_positions: torch.Tensor
    image_mask: torch.Tensor

    def to(self, device: torch.device) -> VisionInputs:
        return VisionInputs(
            None if self.images is None else self.images.to(device),
            to_device(self.rope_positions, device),
            to_device(self.image_mask, device),
        )

    def window(self, columns: slice) -> VisionInputs:
        """The same inputs for the columns ``columns`` of the padded rows (images unchanged: the
        window holds every valid token)."""
        return dataclasses.replace(
            self, rope_positions=self.rope_positions[:, :, columns], image_mask=self.image_mask[:, columns]
        )


def row_images(images: Sequence[ImageInputs | None] | None, rows: int) -> list[ImageInputs | None]:
    """The ``images`` column as a list of ``rows`` entries (all ``None`` without the column), with
    rows holding no image as ``None``."""
    if images is None:
        return [None] * rows
    return [None if image is None or image.num_images == 0 else image for image in images]


def row_rope_positions(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    images: Sequence[ImageInputs | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE positions ``[3, B, S]`` of padded rows ``input_ids [B, S]``, each row's over its
    valid tokens (``attention_mask``), 0 on padding, and the ``[B, S]`` image-token mask. Raises
    naming the row when a row holds fewer placeholder tokens than its images take."""
    batch, width = input_ids.shape
    positions = torch.zeros(3, batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.bool)
    placeholder = image_token_id(vision_language_model(model).config)
    merge = merge_size(vision_language_model(model).config)
    valid_rows = attention_mask.bool().cpu()
    for row, (ids, valid) in enumerate(zip(input_ids.cpu(), valid_rows, strict=True)):
        tokens = ids[valid]
        expected = 0 if images[row] is None else sum(images[row].token_counts(merge))
        found = int((tokens == placeholder).sum())
        if found < expected:
            raise ValueError(
                f"row {row} holds {found} image placeholder tokens but its images (the batch's "
                f"{IMAGES_FIELD!r} field) take {expected}: each image needs its placeholders expanded "
                "in the prompt (tandem.models.vision.expand_image_tokens)"
            )
        positions[:, row, valid], _ = mrope_positions(model, tokens, images[row])
        mask[row, valid] = image_token_mask(tokens, images[row], placeholder, merge)
    return positions, mask


def padded_vision_inputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    images: Sequence[ImageInputs | None] | None,
) -> VisionInputs:
    """The vision inputs of padded rows ``input_ids [B, S]`` with their ``images`` (one entry per row)."""
    images = row_images(images, input_ids.shape[0])
    positions, mask = row_rope_positions(model, input_ids, attention_mask, images)
    present = [image for image in images if image is not None]
    return VisionInputs(ImageInputs.concat(present) if present else None, positions, mask)


def packed_vision_inputs(
    model: nn.Module,
    packed: PackedSequences,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    images: Sequence[ImageInputs | None] | None,
) -> VisionInputs:
    """The vision inputs of ``packed`` (fillers included), packed from the padded rows
    ``input_ids [B, S]`` with their ``images``: each packed token takes the M-RoPE position it has
    in the row it was copied from, fillers 0, and the images follow the packed placeholders (a
    prompt shared by several rows is packed once, from one row: that row's images)."""
    batch, width = input_ids.shape
    images = row_images(images, batch)
    positions, row_mask = row_rope_positions(model, input_ids, attention_mask, images)
    sources = (packed.flat_index if packed.source_index is None else packed.source_index).cpu()
    copied = sources.numel()
    rope = torch.zeros(3, packed.num_tokens, dtype=torch.long)
    rope[:, :copied] = positions.flatten(1).index_select(1, sources)
    mask = torch.zeros(packed.num_tokens, dtype=torch.bool)
    mask[:copied] = row_mask.flatten().index_select(0, sources)
    rows = torch.unique_consecutive(sources[mask[:copied]] // width).tolist()
    present = [images[row] for row in rows]
    return VisionInputs(
        ImageInputs.concat(present) if present else None, rope.unsqueeze(1), mask.unsqueeze(0)
    )


def text_vision_inputs(length: int) -> VisionInputs:
    """The vision inputs of one row of ``length`` text tokens (positions ``0 .. length-1``)."""
    return VisionInputs(
        None, torch.arange(length).expand(3, 1, length).clone(), torch.zeros(1, length, dtype=torch.bool)
    )


def blank_image(model: nn.Module) -> ImageInputs:
    """One all-zero image of a single token (``merge x merge`` patches) for the vision tower."""
    vision = vision_language_model(model).visual.config
    merge = int(vision.spatial_merge_size)
    width = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
    return ImageInputs(torch.zeros(merge * merge, width), torch.tensor([[1, merge, merge]]))


def stored_image_layout(model: nn.Module | Any, prompt_width: int) -> ImageLayout:
    """The widths a stored draw's image columns take for ``model`` (a vision-language model or its
    HF config) and prompts ``prompt_width`` tokens wide (:mod:`tandem.dataplane.images`): every
    image takes at least one of the prompt's tokens and each token ``merge**2`` patches, so a row
    holds at most ``prompt_width`` images of ``prompt_width * merge**2`` patches together. Bounds
    from the prompt width alone, so that every rank's and replica's block (and every draw) has one
    schema; the controller crops them to the draw's own."""
    vision = getattr(model, "config", model).vision_config
    width = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
    merge = int(vision.spatial_merge_size)
    return ImageLayout(prompt_width, prompt_width * merge * merge, width)


def model_image_layout(model_path: str, prompt_width: int) -> ImageLayout | None:
    """:func:`stored_image_layout` of the model in ``model_path`` (its config read from disk: a
    rollout replica holds no trainer module); ``None`` for a text model."""
    config = AutoConfig.from_pretrained(model_path)
    return stored_image_layout(config, prompt_width) if is_vision_language(config) else None


def decoder_inputs(
    model: nn.Module, input_ids: torch.Tensor, vision: VisionInputs
) -> dict[str, torch.Tensor]:
    """The language model's keywords for ``input_ids [B, S]``: ``inputs_embeds [B, S, H]`` with the
    image placeholders' rows replaced by the vision tower's features of ``vision.images``, and
    ``position_ids`` the ``[3, B, S]`` M-RoPE positions. Runs the vision tower (on a blank image,
    whose features enter times zero, when there is none: see the module's docstring); without
    gradients when none of its parameters trains."""
    tower = vision_language_model(model).visual
    trains = any(param.requires_grad for param in tower.parameters())
    with torch.set_grad_enabled(trains and torch.is_grad_enabled()):
        features = image_features(model, blank_image(model) if vision.images is None else vision.images)
    mask = vision.image_mask.to(input_ids.device)
    if vision.images is None:
        embeds = embed_with_images(model, input_ids, None, mask)
        embeds = embeds + 0.0 * features.sum().to(embeds.dtype)
    else:
        embeds = embed_with_images(model, input_ids, features, mask)
    return {"inputs_embeds": embeds, "position_ids": vision.rope_positions.to(input_ids.device)}


def images_key(images: ImageInputs | None) -> bytes | None:
    """A key equal for equal images (:attr:`ImageInputs.digest`, computed once per object),
    ``None`` without images: rows sharing a prompt must share its images too."""
    return None if images is None or images.num_images == 0 else images.digest


def check_images_field(images: Sequence[ImageInputs | None] | None, vision_language: bool) -> None:
    """Refuse a batch whose ``images`` field holds images for a text model (they would be
    silently ignored), or holds something other than :class:`ImageInputs` or ``None``."""
    if images is None:
        return
    for row, image in enumerate(images):
        if image is None:
            continue
        if not isinstance(image, ImageInputs):
            raise ValueError(
                f"the batch's {IMAGES_FIELD!r} field holds a {type(image).__name__} in row {row}; each row "
                "holds an ImageInputs (tandem.protocol.images) or None"
            )
        if not vision_language and image.num_images:
            raise ValueError(
                f"row {row} of the batch has images (the {IMAGES_FIELD!r} field) but the engine's model is a "
                "text model: train a vision-language model, or drop the images"
            )
