"""Images in the rollout engines: which requests may carry them, the digest that keeps prompts
with different images apart in a prefix cache, and the native engine's packed VLM inputs.

A vision-language request carries its images (:class:`~tandem.protocol.images.ImageInputs`) and a
prompt whose ``<|image_pad|>`` tokens are already expanded, one per image token. Two requests
share a prompt's keys and values only when both their token ids and their images are equal, so
every prefix key holds the images' digest (:attr:`ImageInputs.digest`, computed once per object).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.models.vision import (
    embed_with_images,
    image_features,
    image_token_id,
    image_token_mask,
    is_vision_language,
    merge_size,
    mrope_positions,
)
from tandem.protocol.generation import RolloutRequest
from tandem.protocol.images import ImageInputs


def has_images(request: RolloutRequest) -> bool:
    return request.images is not None and request.images.num_images > 0


def image_request_problem(request: RolloutRequest, model_config, exact: bool = False) -> str | None:
    """Why a model with ``model_config`` cannot take ``request``'s images (``None`` when it can):
    images for a text-only model, fewer image tokens than the images take, or image tokens
    without images. More placeholder tokens than the images take are allowed (those after the
    images' own are ordinary tokens: :func:`~tandem.models.vision.image_token_mask`; an agent's
    context may hold one a model turn sampled) unless ``exact`` (HF's ``generate`` counts every
    placeholder as an image token)."""
    config = getattr(model_config, "config", model_config)
    if not is_vision_language(config):
        if not has_images(request):
            return None
        count = request.images.num_images
        return (
            f"the request carries {count} image{'s' * (count != 1)} but {config.model_type!r} is a "
            f"text-only model (it has no vision tower)"
        )
    placeholder = image_token_id(config)
    found = sum(1 for token in request.prompt_ids if token == placeholder)
    expected = sum(request.images.token_counts(merge_size(config))) if has_images(request) else 0
    if found < expected or (found > expected and (exact or not has_images(request))):
        count = request.images.num_images if has_images(request) else 0
        return (
            f"the prompt holds {found} <|image_pad|> tokens but its {count} image{'s' * (count != 1)} "
            f"take {expected} (expand each image's placeholder with tandem.models.vision.expand_image_tokens)"
        )
    return None


def packed_vision_inputs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    prompts: list[tuple[int, int, ImageInputs | None]],
    decode_positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A VLM's inputs for one packed row of the native engine.

    Args:
        input_ids: ``[1, T]``: the prompts computed in this step, then one decode token per
            running request.
        prompts: each computed prompt's ``(token_start, token_end, images)`` in the row, in order.
        decode_positions: ``[D]`` each decode token's M-RoPE position (its text position plus
            its request's delta).

    Returns:
        ``inputs_embeds [1, T, H]`` (image tokens replaced by the vision tower's features of
        their prompt's images; decode tokens are plain text tokens), M-RoPE ``position_ids
        [3, 1, T]`` and each computed prompt's delta.
    """
    prefill_length = prompts[-1][1] if prompts else 0
    with_images = [images for _, _, images in prompts if images is not None and images.num_images]
    features = image_features(model, ImageInputs.concat(with_images)) if with_images else None
    placeholder, merge = image_token_id(model.config), merge_size(model.config)
    mask = torch.zeros(1, prefill_length, dtype=torch.bool, device=input_ids.device)
    for start, end, images in prompts:  # each prompt's own image tokens (image_token_mask)
        mask[0, start:end] = image_token_mask(input_ids[0, start:end], images, placeholder, merge)
    embeds = torch.cat(
        [
            embed_with_images(model, input_ids[:, :prefill_length], features, mask),
            model.get_input_embeddings()(input_ids[:, prefill_length:]),
        ],
        dim=1,
    )
    rows, deltas = [], []
    for start, end, images in prompts:
        positions, delta = mrope_positions(model, input_ids[0, start:end], images)
        rows.append(positions)
        deltas.append(delta)
    rows.append(decode_positions.to(input_ids.device).expand(3, -1))
    return embeds, torch.cat(rows, dim=1).unsqueeze(1), deltas


def collapse_image_tokens(
    token_ids: Sequence[int], images: ImageInputs, placeholder: int, merge: int
) -> list[int]:
    """The inverse of :func:`~tandem.models.vision.expand_image_tokens`: each image's run of
    ``placeholder`` tokens back to one (vLLM expands them itself)."""
    counts = iter(images.token_counts(merge))
    collapsed, index = [], 0
    while index < len(token_ids):
        collapsed.append(token_ids[index])
        index += next(counts) if token_ids[index] == placeholder else 1
    return collapsed


def rebuilt_pictures(images: ImageInputs, processor) -> list[np.ndarray]:
    """Each image as the ``uint8 [H, W, 3]`` picture that Qwen2-VL's image ``processor`` resized
    and cut into ``images``' patches (the inverse of its patching and normalisation: feeding
    the pictures to the same processor gives the same patches). An engine that runs the image
    processor itself (vLLM) takes these."""
    patch, temporal, merge = processor.patch_size, processor.temporal_patch_size, processor.merge_size
    mean = torch.tensor(processor.image_mean).view(-1, 1, 1)
    std = torch.tensor(processor.image_std).view(-1, 1, 1)
    pictures, start = [], 0
    for frames, rows, cols in images.image_grid_thw.tolist():
        count = frames * rows * cols
        patches = images.pixel_values[start : start + count].detach().float().cpu()
        start += count
        # The processor's layout: [t, h/m, w/m, m, m, C, T, p, p] <- [t, T, C, h/m, m, p, w/m, m, p]
        grid = patches.reshape(frames, rows // merge, cols // merge, merge, merge, -1, temporal, patch, patch)
        pixels = grid.permute(0, 6, 5, 1, 3, 7, 2, 4, 8).reshape(
            frames * temporal, -1, rows * patch, cols * patch
        )
        picture = (pixels[0] * std + mean) / processor.rescale_factor
        pictures.append(picture.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy())
    return pictures
