"""The RL and SFT datasets read images through one decoder and one prompter: the same bytes give
the same tensors, and the same bad bytes the same error, naming the file, row, field and image."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from tandem.data import write_parquet
from tandem.models.loading import load_tokenizer
from tandem.models.tiny_vlm import TinyVLMConfig, save_tiny_vlm
from tandem.models.vision import ImagePrompter, load_image_processor, process_images
from tandem.rl.config import RLDataConfig, RLImageConfig
from tandem.rl.data import RLDataset, image_reader
from tandem.sft.data import SFTDataConfig, SFTDataset


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm"), TinyVLMConfig(family="qwen2_vl"))


def png(height: int, width: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def load_rl(folder, vlm_dir, entries):
    row = {
        "data_source": "shapes",
        "prompt": [{"role": "user", "content": "<image>" * len(entries) + "what?"}],
        "images": entries,
        "reward_model": {"ground_truth": "a"},
    }
    path = write_parquet([row], folder / "rows.parquet")
    config = RLDataConfig(train_path=str(path), image=RLImageConfig(max_image_pixels=200 * 200))
    data = RLDataset.load(path, load_tokenizer(vlm_dir), 4096, "error", images=image_reader(vlm_dir, config))
    return data.image_inputs(data.samples[0])


def load_sft(folder, vlm_dir, entries):
    messages = [
        {"role": "user", "content": "<image>" * len(entries) + "what?"},
        {"role": "assistant", "content": "a"},
    ]
    path = write_parquet([{"messages": messages, "images": entries}], folder / "rows.parquet")
    config = SFTDataConfig(max_length=4096, max_image_pixels=200 * 200)
    return SFTDataset.load(path, load_tokenizer(vlm_dir), config, ImagePrompter.for_model(vlm_dir)).images[0]


def test_both_datasets_give_the_images_processed_by_hand(vlm_dir, tmp_path):
    pictures = [png(60, 90, 0), png(112, 56, 1)]
    entries = [{"bytes": raw} for raw in pictures]
    (tmp_path / "rl").mkdir(), (tmp_path / "sft").mkdir()
    rl, sft = load_rl(tmp_path / "rl", vlm_dir, entries), load_sft(tmp_path / "sft", vlm_dir, entries)
    decoded = [Image.open(io.BytesIO(raw)).convert("RGB") for raw in pictures]
    want = process_images(load_image_processor(vlm_dir), decoded)  # the reference: one call, by hand
    for got in (rl, sft):
        torch.testing.assert_close(got.pixel_values, want.pixel_values, rtol=0, atol=0)
        assert torch.equal(got.image_grid_thw, want.image_grid_thw)


BAD = {
    "not an image": ([{"bytes": b"not a png"}], "image 0: the bytes are not an image Pillow can read"),
    "over the pixel limit": ([{"bytes": png(300, 300, 3)}], "image 0: the image is 300x300 = 90000 pixels"),
    "the processor's aspect ratio": (
        [{"bytes": png(56, 56, 5)}, {"bytes": png(2, 500, 6)}],
        "image 1 (500x2): absolute aspect ratio must be smaller than 200",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_both_datasets_refuse_bad_images_with_one_message(vlm_dir, tmp_path, case):
    entries, reason = BAD[case]
    errors = {}
    for name, load in (("rl", load_rl), ("sft", load_sft)):
        (tmp_path / name).mkdir()
        with pytest.raises(ValueError) as raised:
            load(tmp_path / name, vlm_dir, entries)
        errors[name] = str(raised.value).replace(str(tmp_path / name), "<folder>")
    assert errors["rl"].startswith(f"<folder>/rows.parquet: row 0: field 'images' {reason}")
    # one message, each naming its own dataset's key for the pixel limit
    assert errors["rl"].replace("data.image.max_image_pixels", "data.max_image_pixels") == errors["sft"]
