"""Image prompts in a stored draw (:mod:`tandem.dataplane.images`): the rows' ``ImageInputs`` put as
tensor columns by ``store_rollout``, cropped by ``trim_stored`` and fetched by a rank that reads
``images`` equal, row for row and bit for bit, the ``images`` the same row operations give on the
``Batch`` the draw was stored from; no Python object of the images stays inline."""

import pytest
import torch

from tandem.dataplane import ShmStore, get, traffic
from tandem.dataplane.images import (
    IMAGE_COUNT,
    IMAGE_GRIDS,
    IMAGE_PATCHES,
    IMAGE_PIXELS,
    ImageLayout,
    image_columns,
    materialise_with_images,
)
from tandem.engine.forward_fields import FORWARD_FIELDS
from tandem.pipeline.stored_rollout import concat_stored, store_rollout, trim_stored
from tandem.protocol.images import IMAGES_FIELD, ImageInputs
from tests.dataplane.conftest import padded_batch

LAYOUT = ImageLayout(max_images=4, max_patches=40, patch_dim=6)


def picture(patches_h: int, patches_w: int, seed: int, images: int = 1) -> ImageInputs:
    """``images`` images of ``patches_h x patches_w`` patches of random pixels, the first patch a
    background value every picture shares (so the rows' first values tie with the padding's zeros:
    the encoder must still take zeros as its fill) and the last zeros (a pad-valued patch at the end
    of a row's window must survive the round trip)."""
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(images * patches_h * patches_w, LAYOUT.patch_dim, generator=gen)
    pixels[0], pixels[-1] = -1.79, 0.0
    return ImageInputs(pixels, torch.tensor([[1, patches_h, patches_w]] * images))


def image_rows(rows: int) -> list[ImageInputs | None]:
    """Groups of two rows sharing one object (as a group's responses do), a text-only group,
    a row with two images."""
    one, two, three = picture(2, 3, 0), picture(4, 4, 1), picture(2, 2, 2, images=2)
    pattern = [one, one, None, None, two, two, three]
    return [pattern[i % len(pattern)] for i in range(rows)]


@pytest.fixture
def store(tmp_path):
    return ShmStore(str(tmp_path))


def assert_same_images(got, want) -> None:
    assert len(got) == len(want)
    for row, (a, b) in enumerate(zip(got, want, strict=True)):
        if b is None:
            assert a is None, row
            continue
        assert (
            a.pixel_values.dtype == b.pixel_values.dtype and a.image_grid_thw.dtype == b.image_grid_thw.dtype
        )
        assert torch.equal(a.pixel_values, b.pixel_values), row
        assert torch.equal(a.image_grid_thw, b.image_grid_thw), row


def test_stored_images_fetch_as_the_batch_rows_images_bit_for_bit(store):
    batch = padded_batch(rows=14)
    batch = batch.assign(non_tensors={IMAGES_FIELD: image_rows(len(batch))})
    ref = trim_stored(store_rollout(batch, store, tokenizer=None, decode=False, images=LAYOUT))
    assert {IMAGE_PIXELS, IMAGE_GRIDS} <= set(ref.stored_fields())
    assert IMAGES_FIELD not in ref.scalars and {IMAGE_PATCHES, IMAGE_COUNT} <= set(ref.scalars.keys())
    # cropped to the draw's most patches (16, after the leading zero row) and images (2), not the bounds
    assert ref.schema[IMAGE_PIXELS].shape == (1 + 16, LAYOUT.patch_dim)
    assert ref.schema[IMAGE_GRIDS].shape == (2, 3)
    order = torch.tensor([5, 4, 0, 13, 1, 2, 6, 9])  # a rank's rows, reordered, some repeated groups
    fetched = materialise_with_images(ref[order], get, FORWARD_FIELDS)
    assert_same_images(list(fetched[IMAGES_FIELD]), list(batch[order][IMAGES_FIELD]))
    assert not {IMAGE_PIXELS, IMAGE_GRIDS, IMAGE_PATCHES, IMAGE_COUNT} & set(fetched.keys())
    rows = list(fetched[IMAGES_FIELD])
    # rows whose images one row holds share one object (rows 5, 4: ``two``; 0, 1: ``one``) ...
    assert rows[0] is rows[1] and rows[2] is rows[4] and rows[0] is not rows[2]
    # ... and its pixels are read once: the fetch reads each holder's patches (its last one: zeros)
    before = traffic()
    materialise_with_images(ref[order], get, [IMAGES_FIELD])
    held = {id(image): image for image in batch[order][IMAGES_FIELD] if image is not None}.values()
    read = sum(image.pixel_values.shape[0] - 1 for image in held) * LAYOUT.patch_dim * 4
    assert (traffic() - before).fetched_by_field[IMAGE_PIXELS] == read
    # asked without images, none is fetched; asked for everything, they come back too
    assert IMAGES_FIELD not in materialise_with_images(ref, get, ["input_ids"])
    assert_same_images(list(materialise_with_images(ref, get)[IMAGES_FIELD]), list(batch[IMAGES_FIELD]))
    store.discard_all()


def test_stored_image_draws_join_and_crop_to_the_joined_widths(store):
    """Two draws (DAPO's) stored at one layout join; the join crops to the widest rows of both."""
    small = padded_batch(rows=4, seed=1).assign(
        non_tensors={IMAGES_FIELD: [picture(1, 2, 3)] * 2 + [None] * 2}
    )
    large = padded_batch(rows=7, seed=2).assign(non_tensors={IMAGES_FIELD: image_rows(7)})
    refs = [trim_stored(store_rollout(b, store, None, decode=False, images=LAYOUT)) for b in (small, large)]
    assert refs[0].schema[IMAGE_PIXELS].shape[0] == 1 + 2
    joined = trim_stored(concat_stored(refs))
    assert joined.schema[IMAGE_PIXELS].shape[0] == 1 + 16
    fetched = materialise_with_images(joined, get, [IMAGES_FIELD])
    want = [*small[IMAGES_FIELD], *large[IMAGES_FIELD]]
    assert_same_images(list(fetched[IMAGES_FIELD]), want)
    store.discard_all()


def test_text_only_rows_store_empty_image_columns(store):
    """A draw of text prompts only (of a vision-language run) still stores the columns, so that its
    blocks join other ranks' and draws'; every row reads back ``None``."""
    batch = padded_batch(rows=3).assign(non_tensors={IMAGES_FIELD: [None] * 3})
    ref = trim_stored(store_rollout(batch, store, None, decode=False, images=LAYOUT))
    assert ref.schema[IMAGE_PIXELS].shape == (1, LAYOUT.patch_dim)
    assert list(materialise_with_images(ref, get, [IMAGES_FIELD])[IMAGES_FIELD]) == [None] * 3
    store.discard_all()


@pytest.mark.parametrize(
    "image, message",
    [
        (picture(7, 7, 0), "exceed the stored draw's 4 images of 40 patches"),
        (ImageInputs(torch.zeros(4, 5), torch.tensor([[1, 2, 2]])), "float32 \\[patches, 6\\]"),
        (ImageInputs(torch.zeros(4, 6, dtype=torch.float64), torch.tensor([[1, 2, 2]])), "float64"),
        (ImageInputs(torch.zeros(4, 6), torch.tensor([[1, 2, 3]])), "do not hold its 4 patches"),
    ],
)
def test_images_that_do_not_fit_the_layout_are_refused_naming_the_row(image, message):
    with pytest.raises(ValueError, match=f"row 1.*{message}"):
        image_columns([None, image], LAYOUT)


def test_the_padding_costs_no_stored_byte(store):
    """Only each row's own patches reach the store: a fetch of every row reads exactly the rows'
    patches up to their last non-zero one (the layout's padding costs nothing, even where every
    row's first pixel value is the same background value)."""
    images = image_rows(7)
    stored, _ = image_columns(images, LAYOUT)
    block = store.put(stored)
    before = traffic()
    got = store.get(block, [IMAGE_PIXELS], range(7))[IMAGE_PIXELS]
    read = (traffic() - before).fetched_by_field[IMAGE_PIXELS]
    assert got.shape == (7, 1 + LAYOUT.max_patches + 1, LAYOUT.patch_dim)
    held = {id(image): image for image in images if image is not None}.values()  # a group's rows: stored once
    windows = sum(image.pixel_values.shape[0] - 1 for image in held)  # their last patch: zeros
    assert read == windows * LAYOUT.patch_dim * 4
    store.discard_all()


def test_a_rank_with_no_rows_gets_no_images(store):
    batch = padded_batch(rows=3).assign(non_tensors={IMAGES_FIELD: image_rows(3)})
    ref = trim_stored(store_rollout(batch, store, None, decode=False, images=LAYOUT))
    empty = materialise_with_images(ref[torch.tensor([], dtype=torch.long)], get, [IMAGES_FIELD, "input_ids"])
    assert len(empty) == 0 and list(empty[IMAGES_FIELD]) == []
    store.discard_all()
