"""A vision-language draw's images as stored tensor columns, and back to the rows' ``ImageInputs``.

A batch row's images (the ``images`` field: an :class:`~tandem.protocol.images.ImageInputs` or
``None`` per row) are stored in the row's block as two padded fields, jagged like every other
(:mod:`tandem.dataplane.columns`: only each row's own patches and grids reach the store, the
padding costs no byte):

* ``image_pixels [B, 1 + P + 1, D]`` float32: row ``i``'s ``pixel_values [P_i, D]`` at positions
  ``1 .. P_i``, zeros around them (the first and last positions are always zeros: the jagged
  encoder takes its fill from the rows' edges, where a row's first pixel value, often the
  background's, would otherwise tie with the padding's zeros and the windows would span the
  padding);
* ``image_grid_thw [B, I, 3]`` int64: row ``i``'s ``image_grid_thw [I_i, 3]`` at its first ``I_i``
  positions, zeros after (an image's grid has ``t >= 1``: a zero entry is padding);

and, inline, the two per-row widths the controller crops them to (``image_patches [B]``,
``image_count [B]`` int64: :func:`tandem.pipeline.stored_rollout.trim_stored`) and ``image_row
[B]`` int64, the row of the same block that holds row ``i``'s images: a group's ``n`` rows share
one ``ImageInputs`` object, which only the first of them stores (the others' windows are empty).
Every block of a run stores them at one :class:`ImageLayout` (widths bounded by the prompt width),
so draws and ranks' blocks join. A rank that reads ``images`` (``@register(reads=...)``) fetches
the holding rows of its rows, each once, and gets the ``images`` field back
(:func:`materialise_with_images`), equal bit for bit to the rows' ``ImageInputs`` as generated,
rows of one holder sharing one object.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.dataplane.batch_ref import BatchRef, Getter, RefPart
from tandem.dataplane.columns import UnpaddedField
from tandem.protocol import Batch
from tandem.protocol.images import IMAGES_FIELD, ImageInputs

IMAGE_PIXELS = "image_pixels"  # [B, 1 + P + 1, D] float32: each row's patches from position 1, zeros around
IMAGE_GRIDS = "image_grid_thw"  # [B, I, 3] int64: each row's images' (t, h, w), zero rows after
IMAGE_PATCHES = "image_patches"  # [B] int64, inline: P_i, the patches row i's images hold
IMAGE_COUNT = "image_count"  # [B] int64, inline: I_i, row i's images
IMAGE_SOURCE = "image_row"  # [B] int64, inline: the row of row i's block that stores its images
STORED_IMAGE_FIELDS = (IMAGE_PIXELS, IMAGE_GRIDS)
IMAGE_WIDTHS = {IMAGE_PIXELS: IMAGE_PATCHES, IMAGE_GRIDS: IMAGE_COUNT}  # stored field: its inline width
IMAGE_COLUMNS = {*STORED_IMAGE_FIELDS, IMAGE_PATCHES, IMAGE_COUNT, IMAGE_SOURCE}  # what "images" is made of
PIXEL_DTYPE = torch.float32  # what the image processors make (tandem.models.vision.process_images)


@dataclass(frozen=True)
class ImageLayout:
    """The widths of a run's stored image columns, the same in every block (so that blocks join).

    Attributes:
        max_images: ``I``, the most images a row may hold.
        max_patches: ``P``, the most patches a row's images may hold together.
        patch_dim: ``D``, one flattened patch's values (``channels * temporal_patch * patch**2``).
    """

    max_images: int
    max_patches: int
    patch_dim: int

    def __post_init__(self) -> None:
        if min(self.max_images, self.max_patches, self.patch_dim) <= 0:
            raise ValueError(f"an ImageLayout's widths must be positive, got {self}")


def image_columns(
    images: Sequence[ImageInputs | None], layout: ImageLayout
) -> tuple[dict[str, torch.Tensor | UnpaddedField], dict[str, torch.Tensor]]:
    """The stored ``{image_pixels [B, 1 + P + 1, D], image_grid_thw [B, I, 3]}`` and inline
    ``{image_patches [B], image_count [B], image_row [B]}`` of the rows' ``images`` (see the module
    docstring): a row holding the same ``ImageInputs`` object as an earlier one stores nothing and
    names that row. The pixels are :class:`~tandem.dataplane.columns.UnpaddedField` (each holding
    row's patches at position 1: the store encodes them as it would the padded tensor, which is
    never built). ``ValueError`` naming the row whose images do not fit ``layout`` or are not
    float32 ``[P_i, D]`` patches."""
    rows = len(images)
    pieces: list[torch.Tensor | None] = [None] * rows
    grids = torch.zeros(rows, layout.max_images, 3, dtype=torch.int64)
    patches = torch.zeros(rows, dtype=torch.int64)
    count = torch.zeros(rows, dtype=torch.int64)
    source = torch.arange(rows, dtype=torch.int64)
    holder: dict[int, int] = {}  # id of an ImageInputs: the first row holding it
    for row, image in enumerate(images):
        if image is None or image.num_images == 0:
            continue
        size, number = image.pixel_values.shape[0], image.num_images
        patches[row], count[row] = size, number
        if id(image) in holder:  # a group's later rows: their images are the first row's
            source[row] = holder[id(image)]
            continue
        _check_fits(row, image, layout)
        holder[id(image)] = row
        pieces[row] = image.pixel_values
        grids[row, :number] = image.image_grid_thw
    width = 1 + layout.max_patches + 1
    pixels = UnpaddedField(tuple(pieces), (1,) * rows, width, (layout.patch_dim,), PIXEL_DTYPE)
    stored = {IMAGE_PIXELS: pixels, IMAGE_GRIDS: grids}
    return stored, {IMAGE_PATCHES: patches, IMAGE_COUNT: count, IMAGE_SOURCE: source}


def _check_fits(row: int, image: ImageInputs, layout: ImageLayout) -> None:
    values, grid = image.pixel_values, image.image_grid_thw
    if values.dtype != PIXEL_DTYPE or values.ndim != 2 or values.shape[1] != layout.patch_dim:
        raise ValueError(
            f"row {row}'s images (the {IMAGES_FIELD!r} field) hold pixel values {values.dtype} "
            f"{tuple(values.shape)}; the stored draw takes float32 [patches, {layout.patch_dim}]"
        )
    if int(grid.prod(-1).sum()) != values.shape[0] or bool((grid[:, 0] < 1).any()):
        raise ValueError(f"row {row}'s image grids {grid.tolist()} do not hold its {values.shape[0]} patches")
    if values.shape[0] > layout.max_patches or image.num_images > layout.max_images:
        raise ValueError(
            f"row {row}'s {image.num_images} images of {values.shape[0]} patches exceed the stored "
            f"draw's {layout.max_images} images of {layout.max_patches} patches (the prompt width's bound)"
        )


def image_window(name: str, ref: BatchRef) -> tuple[int, int, int]:
    """The crop ``(axis, start, stop)`` of stored image field ``name`` of ``ref`` to its rows' most
    patches (with the leading zero row) or most images, by their inline widths (at least one)."""
    widest = int(ref[IMAGE_WIDTHS[name]].max()) if len(ref) else 0
    return (0, 0, 1 + widest) if name == IMAGE_PIXELS else (0, 0, max(1, widest))


def images_of_columns(pixels: torch.Tensor, grids: torch.Tensor) -> list[ImageInputs | None]:
    """Each row's :class:`ImageInputs` (``None``: none) from ``pixels [B, 1 + P', D]`` and ``grids
    [B, I', 3]`` as a row holding its images stores them (:func:`image_columns`, materialised,
    possibly cropped by :func:`image_window`)."""
    out: list[ImageInputs | None] = []
    for row in range(grids.shape[0]):
        number = int((grids[row, :, 0] > 0).sum())
        grid = grids[row, :number]
        out.append(ImageInputs(pixels[row, 1 : 1 + int(grid.prod(-1).sum())], grid) if number else None)
    return out


def stored_images(ref: BatchRef, get: Getter) -> list[ImageInputs | None]:
    """Each row's images, fetched from the block row that holds them (``image_row``): each distinct
    holder once, its object shared by the rows it holds the images of (a group's, as the rows
    they were generated from shared one)."""
    if len(ref) == 0:
        return []
    part = next((p for p in ref.parts if IMAGE_PIXELS in p.fields), None)
    if part is None or IMAGE_GRIDS not in part.fields or IMAGE_SOURCE not in ref.scalars:
        raise ValueError(
            f"a stored draw's images need {IMAGE_PIXELS!r} and {IMAGE_GRIDS!r} stored together and "
            f"{IMAGE_SOURCE!r} inline (tandem.dataplane.images.image_columns); this batch has {ref.keys()}"
        )
    holders = np.stack([part.block_of_row.astype(np.int64), ref.scalars[IMAGE_SOURCE].numpy()], axis=1)
    distinct, inverse = np.unique(holders, axis=0, return_inverse=True)
    rows = RefPart(STORED_IMAGE_FIELDS, part.blocks, distinct[:, 0].astype(np.int32), distinct[:, 1])
    fetched = BatchRef(Batch({}, batch_size=len(distinct)), [rows], ref.schema).materialise(get)
    images = images_of_columns(fetched[IMAGE_PIXELS], fetched[IMAGE_GRIDS])
    return [images[i] for i in inverse.reshape(-1)]


def materialise_with_images(ref: BatchRef, get: Getter, fields: Iterable[str] | None = None) -> Batch:
    """``ref.materialise(get, fields)`` of the ``fields`` ``ref`` holds (all when ``None``), with the
    ``images`` field rebuilt from its stored columns when asked (:func:`stored_images`) and the
    columns themselves left out."""
    if not all(name in ref.schema for name in STORED_IMAGE_FIELDS):
        return ref.materialise(get, None if fields is None else [f for f in fields if f in ref])
    wanted = ref.keys() + [IMAGES_FIELD] if fields is None else list(fields)
    held = [f for f in wanted if f in ref and f not in IMAGE_COLUMNS]
    batch = ref.materialise(get, held)
    return (
        batch.assign(non_tensors={IMAGES_FIELD: stored_images(ref, get)}) if IMAGES_FIELD in wanted else batch
    )
