"""Store round trips: put, then get of some fields of some rows, equals the padded tensors'
rows bit for bit, for every dtype; the wire form is narrow and jagged; release leaves no file."""

import os

import pytest
import torch

from tandem.dataplane import ShmStore, traffic
from tandem.dataplane.columns import encode_field, wire_nbytes
from tandem.dataplane.config import DataPlaneConfig

DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool,
          torch.float32, torch.float64, torch.float16, torch.bfloat16]  # fmt: skip


def jagged(dtype: torch.dtype, rows: int = 6, width: int = 9, trailing: tuple = ()) -> torch.Tensor:
    """Right-padded rows of random values (with NaN, -0.0 and inf among the floats)."""
    gen = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        values = torch.rand(rows, width, *trailing, generator=gen) > 0.5
    elif dtype.is_floating_point:
        values = torch.randn(rows, width, *trailing, generator=gen).to(dtype)
        values.view(-1)[:3] = torch.tensor([float("nan"), -0.0, float("inf")]).to(dtype)
    else:
        high = 2 if dtype == torch.uint8 else torch.iinfo(dtype).max
        values = torch.randint(0, high, (rows, width, *trailing), generator=gen).to(dtype)
    lengths = torch.tensor([0, width, 3, 1, width - 1, 5])[:rows]
    keep = torch.arange(width) < lengths[:, None]
    return torch.where(
        keep.reshape(rows, width, *([1] * len(trailing))), values, torch.zeros((), dtype=dtype)
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture
def store(tmp_path):
    return ShmStore(str(tmp_path))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shm_round_trip_is_bit_exact_for_every_dtype(store, dtype):
    fields = {
        "tokens": jagged(dtype),
        "dense": jagged(dtype)[:, 0],
        "experts": jagged(dtype, trailing=(2, 3)),
    }
    block = store.put(fields)
    for rows in ([0, 1, 2, 3, 4, 5], [1, 2, 4], [5], []):
        got = store.get(block, list(fields), rows)
        for name, tensor in fields.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor[rows].shape
            assert torch.equal(bits(got[name]), bits(tensor[rows])), (name, rows)
    store.release(block)


def test_wire_is_jagged_and_narrow(batch):
    """Token ids int32 (or narrower) without padding, masks one byte, log-probs fp32: per real
    token the responses take 4 bytes where the padded int64 layout took 8 per slot."""
    column, arrays = encode_field("responses", batch["responses"])
    lengths = batch["attention_mask"][:, batch["prompts"].shape[1] :].sum(1)
    assert column.jagged and arrays["responses.values"].dtype == torch.int32
    assert arrays["responses.values"].numel() == int(lengths[1:].sum())  # row 0 holds only pad ids: trimmed
    mask_column, mask_arrays = encode_field("response_mask", batch["response_mask"])
    assert mask_column.constant_bits == 1 and "response_mask.values" not in mask_arrays  # ones: windows only
    holes = batch["response_mask"].clone()
    holes[1, 1] = 0  # an agent's tool tokens inside the response: the mask's values travel, one byte each
    _, hole_arrays = encode_field("response_mask", holes)
    assert hole_arrays["response_mask.values"].dtype == torch.uint8
    _, lp = encode_field("rollout_log_probs", batch["rollout_log_probs"])
    assert lp["rollout_log_probs.values"].dtype == torch.float32
    assert wire_nbytes({"responses": batch["responses"]}) == 4 * int(lengths[1:].sum())


def test_get_reads_only_the_asked_rows_and_fields(store, batch):
    fields = {k: batch[k] for k in ("input_ids", "rollout_log_probs")}
    block = store.put(fields)
    before = traffic()
    store.get(block, ["rollout_log_probs"], [2, 3, 6])
    fetched = traffic() - before
    expected = wire_nbytes({"rollout_log_probs": batch["rollout_log_probs"][[2, 3, 6]]})
    assert fetched.fetched_bytes == expected
    assert fetched.fetched_index_bytes == 3 * (4 + 4)  # an int32 length and start per row
    store.release(block)


def test_release_deletes_the_file_and_a_released_block_is_a_clear_error(store, batch):
    block = store.put({"input_ids": batch["input_ids"]})
    assert os.path.exists(block.path)
    store.release(block)
    store.release(block)  # idempotent
    assert not os.listdir(store.directory)
    with pytest.raises(FileNotFoundError, match="released, or this process is not on its writer's host"):
        store.get(block, ["input_ids"], [0])


def test_bad_requests_name_what_is_wrong(store, batch):
    block = store.put({"input_ids": batch["input_ids"]})
    with pytest.raises(KeyError, match="no fields \\['responses'\\]"):
        store.get(block, ["responses"], [0])
    with pytest.raises(IndexError, match="outside the block's 7 rows"):
        store.get(block, ["input_ids"], [7])
    with pytest.raises(ValueError, match="sorted, unique"):
        store.get(block, ["input_ids"], [2, 1])
    with pytest.raises(ValueError, match="dataplane.engine='nvme' is not one of"):
        DataPlaneConfig(engine="nvme")
    store.release(block)
