"""SFT rows with images (verl's multimodal schema) against the prompt built by hand."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from tandem.data import write_parquet
from tandem.models import TinyModelConfig, load_tokenizer, save_tiny_model
from tandem.models.chat import template_ids
from tandem.models.tiny_vlm import save_tiny_vlm
from tandem.models.vision import ImagePrompter
from tandem.sft.data import SFTDataConfig, SFTDataset


def png(height: int, width: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")


def conversation(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def test_images_expand_into_prompt_tokens_outside_the_loss(vlm_dir, tmp_path):
    pictures = [png(60, 90, 0), png(112, 112, 1)]
    (tmp_path / "b.png").write_bytes(pictures[1])
    rows = [
        {
            "messages": conversation("<image>how many?<image>", "2"),
            "images": [{"bytes": pictures[0]}, {"path": "b.png"}],
        },
        {"messages": conversation("no picture", "ok"), "images": None},
    ]
    tokenizer, prompter = load_tokenizer(vlm_dir), ImagePrompter.for_model(vlm_dir)
    data = SFTDataset.load(
        write_parquet(rows, tmp_path / "sft.parquet"), tokenizer, SFTDataConfig(), prompter
    )

    parts = [{"type": "image"}, {"type": "text", "text": "how many?"}, {"type": "image"}]
    decoded = [Image.open(io.BytesIO(raw)).convert("RGB") for raw in pictures]
    whole = template_ids(
        tokenizer, [{"role": "user", "content": parts}, {"role": "assistant", "content": "2"}], False
    )
    expected, images = prompter.prompt(whole, decoded)
    ids, mask = data.samples[0]
    assert ids == expected
    assert torch.equal(data.images[0].pixel_values, images.pixel_values)
    assert torch.equal(data.images[0].image_grid_thw, images.image_grid_thw)
    image_positions = [i for i, token in enumerate(ids) if token == prompter.placeholder]
    assert len(image_positions) == sum(images.token_counts(prompter.merge)) and not any(
        mask[i] for i in image_positions
    )
    answer = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert answer.startswith("2")
    assert data.images[1] is None and data.samples[1][0] == template_ids(
        tokenizer, conversation("no picture", "ok"), False
    )

    batch = data.collate([0, 1], tokenizer.pad_token_id)
    assert batch["images"][0] is data.images[0] and batch["images"][1] is None


@pytest.mark.parametrize(
    ("row", "mentions"),
    [
        (
            {"messages": conversation("<image>?", "a"), "images": [{"bytes": b"junk"}]},
            "image 0: the bytes are not an image",
        ),
        ({"messages": conversation("<image>?", "a"), "images": [{"path": "missing.png"}]}, "does not exist"),
        (
            {"messages": conversation("?", "a"), "images": [{"bytes": png(56, 56, 2)}]},
            "0 <image> placeholders and the row 1 images",
        ),
        (
            {"messages": conversation("<image>?", "a"), "images": [{"bytes": png(300, 300, 3)}]},
            "over data.max_image_pixels=40000",
        ),
        (
            {"messages": conversation("<image>?", "a"), "images": [{"path": "/dev/zero"}]},
            "image 0: the image path /dev/zero is not a regular file",
        ),
        (
            {
                "messages": conversation("<image>?<image>", "a"),
                "images": [{"bytes": png(56, 56, 5)}, {"bytes": png(2, 500, 6)}],
            },
            "row 0: field 'images' image 1 (500x2): absolute aspect ratio must be smaller than 200",
        ),
    ],
)
def test_bad_image_rows_are_named(vlm_dir, tmp_path, row, mentions):
    path = write_parquet([row], tmp_path / "bad.parquet")
    config = SFTDataConfig(max_image_pixels=200 * 200)
    with pytest.raises(ValueError, match="row 0") as error:
        SFTDataset.load(path, load_tokenizer(vlm_dir), config, ImagePrompter.for_model(vlm_dir))
    assert mentions in str(error.value)


def test_images_for_a_text_model_and_cut_rows_are_refused(vlm_dir, tmp_path):
    text_model = save_tiny_model(tmp_path / "text", TinyModelConfig())
    assert ImagePrompter.for_model(text_model) is None
    row = {"messages": conversation("<image>?", "a"), "images": [{"bytes": png(56, 56, 4)}]}
    path = write_parquet([row], tmp_path / "rows.parquet")
    with pytest.raises(ValueError, match="row 0: the row has images but the model has no vision tower"):
        SFTDataset.load(path, load_tokenizer(text_model), SFTDataConfig())
    config = SFTDataConfig(max_length=8, truncation="right")
    with pytest.raises(ValueError, match="a row with images is never cut"):
        SFTDataset.load(path, load_tokenizer(vlm_dir), config, ImagePrompter.for_model(vlm_dir))
