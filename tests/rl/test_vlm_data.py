"""verl's multimodal rows in the RL dataset, against the prompt and images built by hand with the
vision helpers; each bad row's error names its file, row and reason."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig

from tandem.data import write_parquet
from tandem.models.chat import template_ids
from tandem.models.loading import load_tokenizer
from tandem.models.tiny import save_tiny_model
from tandem.models.tiny_vlm import TinyVLMConfig, save_tiny_vlm
from tandem.models.vision import (
    expand_image_tokens,
    image_token_id,
    load_image_processor,
    merge_size,
    process_images,
)
from tandem.rl.config import RLDataConfig, RLImageConfig
from tandem.rl.data import RLDataset, image_reader


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm"), TinyVLMConfig(family="qwen2_vl"))


def picture(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def row(content: str, images: list[dict] | None, truth: str = "red") -> dict:
    return {
        "data_source": "shapes",
        "prompt": [{"role": "user", "content": content}],
        "images": images,
        "reward_model": {"ground_truth": truth},
    }


def load(path, model_dir, max_prompt_length=512, overlong="error", **data):
    config = RLDataConfig(train_path=str(path), **data)
    return RLDataset.load(
        path, load_tokenizer(model_dir), max_prompt_length, overlong, images=image_reader(model_dir, config)
    )


def by_hand(model_dir, content_parts: list[dict], images: list[Image.Image], **bounds):
    """The prompt and images as tests/models/test_vision.py builds them, without the dataset."""
    config = AutoConfig.from_pretrained(str(model_dir))
    ids = template_ids(
        load_tokenizer(model_dir), [{"role": "user", "content": content_parts}], add_generation_prompt=True
    )
    inputs = process_images(load_image_processor(model_dir, **bounds), images)
    return expand_image_tokens(ids, inputs, image_token_id(config), merge_size(config)), inputs


def assert_same_images(got, want):
    torch.testing.assert_close(got.pixel_values, want.pixel_values, rtol=0, atol=0)
    assert torch.equal(got.image_grid_thw, want.image_grid_thw)


def test_a_verl_multimodal_row_loads_to_the_prompt_and_images_built_by_hand(vlm_dir, tmp_path):
    wide, tall = picture(60, 90, 0), picture(112, 56, 1)
    text = "<image>Which is redder, this<image> or the first?"
    path = write_parquet(
        [row(text, [{"bytes": png(wide), "path": None}, {"bytes": png(tall), "path": None}])],
        tmp_path / "mm.parquet",
    )
    data = load(path, vlm_dir)
    parts = [
        {"type": "image"},
        {"type": "text", "text": "Which is redder, this"},
        {"type": "image"},
        {"type": "text", "text": " or the first?"},
    ]
    ids, inputs = by_hand(vlm_dir, parts, [wide, tall])
    sample = data.samples[0]
    assert list(sample.prompt_ids) == ids and len(ids) > 40  # two images' tokens, expanded
    assert sample.raw_prompt == [{"role": "user", "content": text}]  # as the file holds it
    batch = data.collate([0])
    assert_same_images(batch["images"][0], inputs)
    assert torch.equal(sample.images.image_grid_thw, inputs.image_grid_thw)


def test_path_entries_equal_bytes_entries(vlm_dir, tmp_path):
    image = picture(80, 100, 2)
    (tmp_path / "pictures").mkdir()
    (tmp_path / "pictures" / "a.png").write_bytes(png(image))
    text = "<image>What is it?"
    by_bytes = load(
        write_parquet([row(text, [{"bytes": png(image), "path": None}])], tmp_path / "b.parquet"), vlm_dir
    )
    relative = load(
        write_parquet([row(text, [{"bytes": None, "path": "pictures/a.png"}])], tmp_path / "r.parquet"),
        vlm_dir,
    )
    absolute = str(tmp_path / "pictures" / "a.png")
    by_absolute = load(
        write_parquet([row(text, [{"path": absolute}])], tmp_path / "other" / "a.parquet"), vlm_dir
    )
    # paths are trusted like the rest of the file (docs/multimodal.md): ".." leaves the data folder
    by_parent = load(
        write_parquet([row(text, [{"path": "../pictures/a.png"}])], tmp_path / "other" / "p.parquet"), vlm_dir
    )
    for data in (relative, by_absolute, by_parent):
        assert data.samples[0].prompt_ids == by_bytes.samples[0].prompt_ids
        assert_same_images(data.collate([0])["images"][0], by_bytes.collate([0])["images"][0])


def test_text_only_rows_in_a_vision_dataset_have_no_images(vlm_dir, tmp_path):
    image = picture(56, 56, 3)
    rows = [
        row("Say red.", None),
        row("<image>Colour?", [{"bytes": png(image), "path": None}]),
        row("Say blue.", []),
    ]
    data = load(write_parquet(rows, tmp_path / "mixed.parquet"), vlm_dir)
    tokenizer = load_tokenizer(vlm_dir)
    plain = template_ids(tokenizer, rows[0]["prompt"], add_generation_prompt=True)
    assert list(data.samples[0].prompt_ids) == plain
    images = data.collate([0, 1, 2])["images"]
    assert images[0] is None and images[2] is None and images[1].num_images == 1


def test_a_text_dataset_batches_without_an_images_column(vlm_dir, tmp_path):
    rows = [{k: v for k, v in row("Say red.", None).items() if k != "images"}]
    data = load(write_parquet(rows, tmp_path / "text.parquet"), vlm_dir)
    assert "images" not in data.collate([0]) and data.samples[0].images is None


def two_rows(tmp_path, bad: dict, good_image: bytes):
    good = row("<image>Colour?", [{"bytes": good_image, "path": None}])
    good = {**dict.fromkeys(bad), **good}  # parquet takes its columns from the first row
    return write_parquet([good, bad], tmp_path / "bad.parquet")


GOOD = png(picture(56, 56, 4))
BAD_ROWS = {
    "corrupt bytes": (
        row("<image>Colour?", [{"bytes": b"\x89PNG not really", "path": None}]),
        r"image 0: the bytes are not an image Pillow can read",
    ),
    "missing path": (
        row("<image>Colour?", [{"bytes": None, "path": "nowhere.png"}]),
        r"image 0: the image file .*nowhere\.png does not exist",
    ),
    "more images": (
        row("<image>Colour?", [{"bytes": GOOD, "path": None}] * 2),
        r"1 <image> placeholder but field 'images' has 2 images",
    ),
    "more placeholders": (
        row("<image><image>Colour?", [{"bytes": GOOD, "path": None}]),
        r"2 <image> placeholders but field 'images' has 1 image",
    ),
    "not a regular file": (
        row("<image>Colour?", [{"bytes": None, "path": "/dev/zero"}]),
        r"image 0: the image path /dev/zero is not a regular file \(a device, folder or pipe\)",
    ),
    "aspect ratio over 200": (  # the processor's own limit, named with the file, row and image
        row("<image>Colour?", [{"bytes": png(picture(2, 500, 6)), "path": None}]),
        r"field 'images' image 0 \(500x2\): absolute aspect ratio must be smaller than 200",
    ),
    "neither": (
        row("<image>Colour?", [{"bytes": None, "path": None}]),
        r"image 0: an image entry needs 'bytes' or a 'path'",
    ),
    "videos": (
        {**row("Colour?", None), "videos": [{"video": "clip.mp4"}]},
        r"field 'videos' holds videos; tandem reads images only",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_rows_name_file_row_and_reason(vlm_dir, tmp_path, case):
    bad, message = BAD_ROWS[case]
    path = two_rows(tmp_path, bad, GOOD)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: row 1: .*{message}"):
        load(path, vlm_dir)


def test_an_entry_that_is_not_a_dict_and_unknown_keys_are_named(vlm_dir, tmp_path):
    path = tmp_path / "bad.jsonl"
    for images, message in [
        (["picture.png"], r"image 0 must be a dict with 'bytes' or 'path', got str"),
        ([{"image": "file:///a.png"}], r"image 0 has keys \['image'\] tandem does not read"),
        ([{"path": "a.png", "max_pixels": -4}], r"image 0: 'max_pixels' must be a positive integer, got -4"),
    ]:
        rows = [row("Say red.", None), row("<image>Colour?", images)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(ValueError, match=rf"bad\.jsonl: row 1: field 'images' {message}"):
            load(path, vlm_dir)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_images_over_the_size_limit_are_refused_before_decoding(vlm_dir, tmp_path, monkeypatch):
    path = two_rows(tmp_path, row("<image>Colour?", [{"bytes": png(picture(60, 90, 5)), "path": None}]), GOOD)
    with pytest.raises(
        ValueError,
        match=r"row 1: field 'images' image 0: the image is 90x60 = 5400 pixels, over data.image.max_image_pixels=4000",
    ):
        load(path, vlm_dir, image=RLImageConfig(max_image_pixels=4000))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)  # Pillow refuses over twice this: 56x56 passes
    with pytest.raises(
        ValueError, match=r"row 1: field 'images' image 0: the image is too large to decode safely"
    ):
        load(path, vlm_dir)


def test_images_for_a_text_model_or_without_a_reader_are_refused(vlm_dir, tmp_path):
    text_model = save_tiny_model(tmp_path / "text_model")
    path = two_rows(tmp_path, row("<image>Colour?", [{"bytes": GOOD, "path": None}]), GOOD)
    with pytest.raises(
        ValueError,
        match=rf"row 0: field 'images' holds 1 image, but the model {re.escape(str(text_model))} has no vision tower",
    ):
        load(path, text_model)
    with pytest.raises(
        ValueError, match=r"row 0: field 'images' holds 1 image, but the model \(none given\)"
    ):
        RLDataset.load(path, load_tokenizer(vlm_dir), 512)


def test_pixel_limits_change_the_grid_and_per_image_limits_override_them(vlm_dir, tmp_path):
    image = picture(112, 112, 6)
    default = load(
        write_parquet([row("<image>Colour?", [{"bytes": png(image)}])], tmp_path / "d.parquet"), vlm_dir
    )
    assert default.samples[0].images.image_grid_thw.tolist() == [[1, 8, 8]]  # 16 image tokens
    small = load(tmp_path / "d.parquet", vlm_dir, image=RLImageConfig(max_pixels=56 * 56))
    ids, inputs = by_hand(
        vlm_dir, [{"type": "image"}, {"type": "text", "text": "Colour?"}], [image], max_pixels=56 * 56
    )
    assert list(small.samples[0].prompt_ids) == ids and inputs.image_grid_thw.tolist() == [[1, 4, 4]]
    assert_same_images(small.collate([0])["images"][0], inputs)
    own = [{"bytes": png(image), "max_pixels": 56 * 56}]
    per_image = load(write_parquet([row("<image>Colour?", own)], tmp_path / "p.parquet"), vlm_dir)
    assert per_image.samples[0].prompt_ids == small.samples[0].prompt_ids
    assert_same_images(per_image.collate([0])["images"][0], inputs)


def test_overlong_image_prompts_are_filtered_or_refused_never_cut(vlm_dir, tmp_path):
    path = two_rows(tmp_path, row("Say red.", None), GOOD)
    data = load(path, vlm_dir, max_prompt_length=30, overlong="filter")
    assert len(data) == 1 and data.filtered == 1 and data.samples[0].images is None
    with pytest.raises(ValueError, match=r"row 0: .*cutting it would cut image tokens"):
        load(path, vlm_dir, max_prompt_length=30, overlong="truncate_left")


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: RLImageConfig(min_pixels=9000, max_pixels=3136),
            "data.image.min_pixels=9000 exceeds data.image.max_pixels=3136",
        ),
        (lambda: RLImageConfig(max_image_pixels=0), "data.image.max_image_pixels=0 is outside"),
        (lambda: RLImageConfig(min_pixels=-1), "data.image.min_pixels=-1 is outside"),
        (lambda: RLDataConfig(train_path="x.parquet", image_key=""), "data.image_key='' must name a column"),
        (
            lambda: RLDataConfig(train_path="x.parquet", image_key="media", video_key="media"),
            "data.image_key and data.video_key are both 'media'",
        ),
    ],
)
def test_image_settings_are_validated_naming_the_key(build, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


def test_the_image_column_follows_data_image_key(vlm_dir, tmp_path):
    rows = [
        {
            **{k: v for k, v in row("<image>Colour?", None).items() if k != "images"},
            "pictures": [{"bytes": GOOD}],
        }
    ]
    data = load(write_parquet(rows, tmp_path / "k.parquet"), vlm_dir, image_key="pictures")
    assert data.samples[0].images.num_images == 1
