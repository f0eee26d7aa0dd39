"""The tiny VLMs and the image helpers against the HF model's own forward and processor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tandem.models.loading import load_tokenizer
from tandem.models.tiny_vlm import TinyVLMConfig, save_tiny_vlm
from tandem.models.vision import (
    embed_with_images,
    expand_image_tokens,
    image_features,
    image_token_id,
    image_token_mask,
    is_vision_language,
    load_image_processor,
    merge_size,
    mrope_positions,
    process_images,
)
from tandem.protocol.images import ImageInputs


def picture(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm_dir(request, tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp(request.param), TinyVLMConfig(family=request.param))


def load_vlm(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()


def prompt_with_images(path, texts_and_images):
    """Token ids of a user turn holding the images then the text, with placeholders expanded."""
    tokenizer = load_tokenizer(path)
    processor = load_image_processor(path)
    model_config = load_vlm(path).config
    text, images = texts_and_images
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    inputs = process_images(processor, images)
    return expand_image_tokens(ids, inputs, image_token_id(model_config), merge_size(model_config)), inputs


def test_forward_through_the_helpers_equals_the_hf_forward(vlm_dir):
    model = load_vlm(vlm_dir)
    assert is_vision_language(model)
    ids, images = prompt_with_images(vlm_dir, ("red or blue?", [picture(60, 90, 0), picture(112, 56, 1)]))
    input_ids = torch.tensor([ids])
    token_types = (input_ids == image_token_id(model.config)).int()
    with torch.no_grad():
        reference = model(
            input_ids=input_ids,
            pixel_values=images.pixel_values,
            image_grid_thw=images.image_grid_thw,
            mm_token_type_ids=token_types,
        ).logits
        embeds = embed_with_images(model, input_ids, image_features(model, images))
        positions, delta = mrope_positions(model, input_ids[0], images)
        hidden = model.get_decoder()(
            inputs_embeds=embeds, position_ids=positions.unsqueeze(1)
        ).last_hidden_state
        logits = model.lm_head(hidden)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)
    assert positions.shape == (3, len(ids))
    assert (
        delta == int(positions.max()) + 1 - len(ids) and delta < 0
    )  # images take fewer positions than tokens


def test_text_only_positions_are_plain():
    ids = torch.arange(7)
    positions, delta = mrope_positions(None, ids, None)
    assert delta == 0 and torch.equal(positions, torch.arange(7).expand(3, 7))


def test_placeholders_must_match_images(vlm_dir):
    grid = ImageInputs(torch.zeros(32, 1176), torch.tensor([[1, 4, 4], [1, 4, 4]]))
    assert expand_image_tokens([5, 9, 6, 9], grid, 9, 2) == [5, 9, 9, 9, 9, 6, 9, 9, 9, 9]
    with pytest.raises(ValueError, match="1 image placeholder and 2 images"):
        expand_image_tokens([5, 9, 6], grid, 9, 2)


def test_pixel_limits_bound_the_grid(vlm_dir):
    big = picture(300, 300, 2)
    default = process_images(load_image_processor(vlm_dir), [big])
    small = process_images(load_image_processor(vlm_dir, max_pixels=56 * 56), [big])
    assert default.image_grid_thw.prod() > small.image_grid_thw.prod()
    assert int(small.image_grid_thw[0, 1] * small.image_grid_thw[0, 2]) * 14 * 14 <= 56 * 56
    with pytest.raises(ValueError, match="min_pixels=9000 exceeds data.image.max_pixels=3136"):
        load_image_processor(vlm_dir, min_pixels=9000, max_pixels=56 * 56)


def test_a_placeholder_token_after_the_images_is_an_ordinary_token(vlm_dir):
    model = load_vlm(vlm_dir)
    prompt, images = prompt_with_images(vlm_dir, ("and?", [picture(56, 84, 3)]))
    placeholder = image_token_id(model.config)
    ids = torch.tensor(prompt + [placeholder, 7, placeholder])  # a response that sampled the token twice
    mask = image_token_mask(ids, images, placeholder, merge_size(model.config))
    assert int(mask.sum()) == sum(images.token_counts(2)) and not mask[-3:].any()
    positions, delta = mrope_positions(model, ids, images)
    after = torch.arange(len(prompt), len(ids)) + delta  # text positions, in all three rows
    assert torch.equal(positions[:, len(prompt) :], after.expand(3, -1))
    with torch.no_grad():
        reference = model(  # HF's own forward of the prompt alone (it cannot take the extra tokens)
            input_ids=torch.tensor([prompt]),
            pixel_values=images.pixel_values,
            image_grid_thw=images.image_grid_thw,
            mm_token_type_ids=mask[None, : len(prompt)].int(),
        ).logits
        embeds = embed_with_images(model, ids[None], image_features(model, images), mask[None])
        hidden = model.get_decoder()(
            inputs_embeds=embeds, position_ids=positions.unsqueeze(1)
        ).last_hidden_state
    torch.testing.assert_close(model.lm_head(hidden)[:, : len(prompt)], reference, atol=1e-5, rtol=1e-5)
