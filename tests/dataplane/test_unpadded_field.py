"""A field given unpadded (:class:`tandem.dataplane.columns.UnpaddedField`: each row's values and
where they sit) is stored exactly as its padded tensor would be, without that tensor being built.
Reference: :func:`encode_field` of the padded tensor (the path every other field takes): the wire
columns and arrays equal bit for bit; a store's round trip gives the padded tensor back."""

import pytest
import torch

from tandem.dataplane import ShmStore
from tandem.dataplane.columns import UnpaddedField, encode, encode_field, encode_unpadded
from tandem.dataplane.images import IMAGE_PIXELS, image_columns
from tests.dataplane.test_stored_images import LAYOUT, image_rows

WIDTH, TRAILING = 12, (3,)


def _pieces(seed: int, dtype=torch.float32) -> UnpaddedField:
    """Rows of every kind: random values, a piece with zeros at both ends (the window is narrower
    than the piece), one of zeros only, a ``-0.0`` (bits unlike zero's: data), none, an empty one."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(8, *TRAILING, generator=gen)
    if not dtype.is_floating_point:
        values = (values * 1000).round()
    values = values.to(dtype)
    edged = torch.cat(
        [torch.zeros(2, *TRAILING, dtype=dtype), values[:3], torch.zeros(1, *TRAILING, dtype=dtype)]
    )
    pieces = [values[:5], edged, torch.zeros(4, *TRAILING, dtype=dtype), None, values[:0], values[5:]]
    at = [1, 3, 2, 1, 4, 8]
    if dtype.is_floating_point:
        signed = torch.zeros(2, *TRAILING, dtype=dtype)
        signed[1, 0] = -0.0
        pieces.append(signed)
        at.append(5)
    return UnpaddedField(tuple(pieces), tuple(at), WIDTH, TRAILING, dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.contiguous()
    return tensor.view(torch.uint8) if tensor.dtype.is_floating_point and tensor.numel() else tensor


def _assert_same_encoding(one, two) -> None:
    (column_one, arrays_one), (column_two, arrays_two) = one, two
    assert column_one == column_two
    assert arrays_one.keys() == arrays_two.keys()
    for name in arrays_one:
        a, b = arrays_one[name], arrays_two[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(_bits(a), _bits(b)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32])
def test_the_unpadded_encoding_is_the_padded_ones_bit_for_bit(dtype):
    field = _pieces(seed=4, dtype=dtype)
    _assert_same_encoding(encode_unpadded("x", field), encode_field("x", field.padded()))


def test_pieces_of_one_value_store_no_values_as_the_padded_field_does():
    ones = torch.ones(3, *TRAILING)
    field = UnpaddedField((ones, None, ones[:1]), (1, 1, 6), WIDTH, TRAILING, torch.float32)
    column, arrays = encode_unpadded("x", field)
    assert column.constant_bits is not None and "x.values" not in arrays
    _assert_same_encoding((column, arrays), encode_field("x", field.padded()))


@pytest.mark.parametrize("rows", [0, 1])
def test_no_rows_or_no_values(rows):
    field = UnpaddedField((None,) * rows, (1,) * rows, WIDTH, TRAILING, torch.float32)
    _assert_same_encoding(encode_unpadded("x", field), encode_field("x", field.padded()))


def test_a_block_with_an_unpadded_field_reads_back_the_padded_tensor(tmp_path):
    store = ShmStore(str(tmp_path))
    field = _pieces(seed=9)
    tokens = torch.arange(len(field.pieces) * 5).reshape(-1, 5)
    block = store.put({"tokens": tokens, "x": field})
    assert [c.name for c in block.columns] == ["tokens", "x"]
    assert block.columns[1] == encode({"x": field.padded()})[0][0]
    got = store.get(block, ["x", "tokens"], [0, 1, 2, 5, 6])
    assert torch.equal(_bits(got["x"]), _bits(field.padded()[[0, 1, 2, 5, 6]]))  # -0.0 kept
    assert torch.equal(got["tokens"], tokens[[0, 1, 2, 5, 6]])
    store.release(block)


@pytest.mark.parametrize(
    "pieces, at, message",
    [
        ((torch.ones(2, 3),), (0,), "row 0's 2 values at column 0 leave the columns 1..10"),
        ((None, torch.ones(10, 3)), (1, 2), "row 1's 10 values at column 2 leave the columns 1..10"),
        ((torch.ones(2, 4),), (1,), r"row 0's piece is torch.float32 \(2, 4\), not torch.float32 \[L, 3\]"),
        ((torch.ones(2, 3, dtype=torch.float64),), (1,), "row 0's piece is torch.float64"),
        ((torch.ones(2, 3),), (1, 1), "1 pieces but 2 places"),
    ],
)
def test_pieces_outside_the_fields_inner_columns_are_refused_naming_the_row(pieces, at, message):
    with pytest.raises(ValueError, match=message):
        UnpaddedField(pieces, at, WIDTH, TRAILING, torch.float32)


def test_the_stored_pixels_are_the_images_own_tensors_never_a_padded_copy():
    """A draw's image pixels reach the store as the rows' own ``pixel_values`` (the group's first
    row holding them), not as ``[B, 1 + P + 1, D]`` zeros written into."""
    images = image_rows(7)
    stored, _ = image_columns(images, LAYOUT)
    pixels = stored[IMAGE_PIXELS]
    assert isinstance(pixels, UnpaddedField) and pixels.shape == (
        7,
        1 + LAYOUT.max_patches + 1,
        LAYOUT.patch_dim,
    )
    holders = {}
    for row, image in enumerate(images):
        if image is not None and id(image) not in holders:
            holders[id(image)] = row
            assert pixels.pieces[row] is image.pixel_values
        else:
            assert pixels.pieces[row] is None
