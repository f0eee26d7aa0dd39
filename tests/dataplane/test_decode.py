"""The one-pass decode against a per-row reference loop: random jagged fields of every dtype the
wire form takes (empty rows, rows of full length, windows in the middle, runs of full rows that
the decode copies as one, fills that are not 0, NaN among floats), any subset of rows, through
each way a block is read: a shared-memory map, the Ray engine's same-node views of its objects,
the compact rows its gather task returns to another node (those two as pure functions here, and
through a real Ray store in :func:`test_the_ray_engine_decodes_like_the_reference`)."""

import os

import numpy as np
import pytest
import torch

from tandem.dataplane import ShmStore
from tandem.dataplane.columns import decode_field, encode_field
from tandem.dataplane.ray_store import _to_numpy, gather_rows, gathered_arrays, stored_arrays
from tandem.dataplane.store import decode_rows
from tandem.dataplane.windows import as_bits, empty_tensors

DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
          torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
          torch.complex64]  # fmt: skip
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
KINDS = ("empty", "full", "full", "left", "right", "middle", "full", "empty", "right", "one")


def random_values(dtype: torch.dtype, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        values = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        values.view(-1)[::7] = float("nan")
        return values
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), shape, generator=gen).to(dtype)


def random_jagged(dtype: torch.dtype, trailing: tuple = (), seed: int = 0) -> torch.Tensor:
    """``[10, 13, *trailing]`` rows of the ``KINDS`` above around a fill that is not 0 (1 of bools,
    NaN of floats, -3 of signed integers)."""
    gen = torch.Generator().manual_seed(seed)
    rows, width = len(KINDS), 13
    if dtype == torch.bool:
        fill = torch.ones((), dtype=dtype)
    elif dtype.is_floating_point or dtype.is_complex:
        fill = torch.full((), float("nan"), dtype=dtype)
    else:
        fill = torch.full((), 7 if dtype == torch.uint8 else -3, dtype=dtype)
    out = fill.expand(rows, width, *trailing).clone()
    values = random_values(dtype, (rows, width, *trailing), gen)
    for i, kind in enumerate(KINDS):
        start, stop = {"empty": (0, 0), "full": (0, width), "left": (4, width), "right": (0, 9),
                       "middle": (3, 8), "one": (6, 7)}[kind]  # fmt: skip
        out[i, start:stop] = values[i, start:stop]
        if stop > start:  # a window's first and last elements differ from the fill
            edge = (~fill).to(dtype) if dtype == torch.bool else torch.zeros((), dtype=dtype)
            out[i, start] = out[i, stop - 1] = edge
    return out


def reference_decode(column, arrays: dict, rows: list[int]) -> torch.Tensor:
    """Rows of fill values, each window copied in by its own loop iteration."""
    fill = torch.full((len(rows), *column.shape), column.fill_bits, dtype=BITS[column.torch_dtype.itemsize])
    out = fill.view(column.torch_dtype)
    values = arrays[f"{column.name}.values"]
    if not column.jagged:
        return values[rows].to(column.torch_dtype)
    offsets, starts = arrays[f"{column.name}.offsets"], arrays[f"{column.name}.starts"]
    for i, row in enumerate(rows):
        begin, end, start = int(offsets[row]), int(offsets[row + 1]), int(starts[row])
        out[i, start : start + end - begin] = values[begin:end].to(column.torch_dtype)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


ROW_SETS = [list(range(len(KINDS))), [0, 1], [1, 2, 3], [1, 6], [0, 7], [2, 5, 6, 9], [4], []]


@pytest.mark.parametrize("trailing", [(), (3,)], ids=["2d", "trailing"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_equals_the_per_row_reference_for_every_dtype(dtype, trailing, tmp_path):
    tensor = random_jagged(dtype, trailing)
    column, arrays = encode_field("field", tensor)
    assert column.jagged and column.fill_bits != 0
    store = ShmStore(str(tmp_path))
    block = store.put({"field": tensor})
    for rows in ROW_SETS:
        expected = reference_decode(column, arrays, rows)
        assert torch.equal(bits(expected), bits(tensor[rows]))  # the reference round-trips
        wanted = np.array(rows, dtype=np.int64)
        (direct,) = empty_tensors([(expected.shape, dtype)])
        decode_field(column, {k: as_bits(v) for k, v in arrays.items()}, wanted, direct)
        mapped = store.get(block, ["field"], rows)["field"]
        ray_object = _to_numpy(arrays)  # what ray.get of the block's object gives back
        same_node = decode_rows([column], stored_arrays([ray_object]), wanted)["field"]
        compact = gathered_arrays([column], gather_rows((column,), wanted, ray_object))
        gathered = decode_rows([column], compact, np.arange(len(rows)))["field"]
        for got in (direct, mapped, same_node, gathered):
            assert got.dtype == tensor.dtype and got.shape == expected.shape
            assert torch.equal(bits(got), bits(expected)), rows
    store.release(block)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16], ids=str)
def test_decode_into_columns_of_wider_rows_leaves_the_other_columns(dtype):
    """A derived field's part (``input_ids``' prompt or response columns): the view decoded into
    equals the reference, and the columns either side of it keep what they held."""
    tensor = random_jagged(dtype)
    column, arrays = encode_field("field", tensor)
    for rows in ROW_SETS:
        expected = reference_decode(column, arrays, rows)
        wider = random_values(dtype, (len(rows), 5 + tensor.shape[1] + 2), torch.Generator().manual_seed(1))
        before = wider.clone()
        view = wider[:, 5 : 5 + tensor.shape[1]]
        decode_field(column, {k: as_bits(v) for k, v in arrays.items()}, np.array(rows, dtype=np.int64), view)
        assert torch.equal(bits(wider[:, 5:-2]), bits(expected)), rows
        assert torch.equal(bits(wider[:, :5]), bits(before[:, :5])) and torch.equal(bits(wider[:, -2:]), bits(before[:, -2:]))


def test_the_ray_engine_decodes_like_the_reference(ray_cluster):
    """Through a real Ray store: the same-node read (views of the object store) and, run as a
    Ray task as another node's reader would, the gather; 2-D, trailing and dense fields at once."""
    from tandem.dataplane.ray_store import RayStore

    store = RayStore()
    gather = ray_cluster.remote(num_cpus=0)(gather_rows)
    for dtype in DTYPES:
        fields = {"field": random_jagged(dtype), "experts": random_jagged(dtype, (3,), seed=1)}
        fields["dense"] = fields["field"][:, 5].contiguous()
        encoded = {name: encode_field(name, tensor) for name, tensor in fields.items()}
        block = store.put(fields)
        for rows in ROW_SETS:
            wanted = np.array(rows, dtype=np.int64)
            reads = [store.get(block, list(fields), rows)]
            if len(rows) in (0, 4, len(KINDS)):  # a task each: three row sets of the eight
                compact = ray_cluster.get(gather.remote(block.columns, wanted, *block.refs))
                reads.append(
                    decode_rows(block.columns, gathered_arrays(block.columns, compact), np.arange(len(rows)))
                )
            for name, (column, arrays) in encoded.items():
                expected = reference_decode(column, arrays, rows)
                for got in (read[name] for read in reads):
                    assert got.dtype == dtype and got.shape == expected.shape
                    assert torch.equal(bits(got), bits(expected)), (dtype, name, rows)
        store.release(block)
    assert store.held_blocks == 0


def test_dense_fields_decode_like_the_reference(tmp_path):
    tensor = random_values(torch.bfloat16, (10,), torch.Generator().manual_seed(2))
    column, arrays = encode_field("scores", tensor)
    assert not column.jagged
    block = ShmStore(str(tmp_path)).put({"scores": tensor})
    for rows in ROW_SETS:
        got = ShmStore(str(tmp_path)).get(block, ["scores"], rows)["scores"]
        assert torch.equal(bits(got), bits(reference_decode(column, arrays, rows)))


def test_a_block_file_shorter_than_its_reference_is_an_error_not_a_crash(tmp_path):
    """A read past the end of a memory map is a SIGBUS; the engine checks the size first."""
    store = ShmStore(str(tmp_path))
    block = store.put({"field": random_jagged(torch.int64)})
    os.truncate(block.path, block.nbytes // 2)
    with pytest.raises(OSError, match="holds .* bytes, its reference says"):
        store.get(block, ["field"], [1])
    store.release(block)
