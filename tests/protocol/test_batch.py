"""Batch ops against loop references, round trips, purity and error messages."""

import numpy as np
import pytest
import torch

from tandem.protocol import Batch, group_ids_from_uids, to_bytes


def make_batch(size: int = 6, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    return Batch(
        tensors={
            "responses": torch.randint(0, 50, (size, 5), generator=gen),
            "response_mask": torch.randint(0, 2, (size, 5), generator=gen),
            "advantages": torch.randn(size, 5, generator=gen),
            "reward_baselines": torch.randn(size, generator=gen),
        },
        non_tensors={
            "uid": [f"u{i // 2}" for i in range(size)],
            "raw_prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(size)],
        },
        meta={"weight_version": 3},
    )


def rows(batch: Batch) -> list[dict]:
    return [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in s.items()} for s in batch]


def test_construction_errors_name_the_field():
    with pytest.raises(ValueError, match="advantages"):
        Batch({"responses": torch.zeros(3, 2, dtype=torch.long), "advantages": torch.zeros(4, 2)})
    with pytest.raises(ValueError, match="uid"):
        Batch({"responses": torch.zeros(3, 2, dtype=torch.long)}, {"uid": ["a", "b"]})
    with pytest.raises(ValueError, match="response_mask"):
        Batch({"response_mask": torch.zeros(3, 2)})  # a float mask is a declared-field error
    with pytest.raises(ValueError, match="advantages"):
        Batch({"advantages": torch.zeros(3)})  # wrong rank
    with pytest.raises(ValueError, match="batch dimension"):
        Batch({"x": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="explicit batch_size"):
        Batch()
    with pytest.raises(ValueError, match="tensor fields"):
        Batch(non_tensors={"obj": [torch.zeros(1)]})


def test_unknown_fields_are_reported_with_available_names():
    batch = make_batch()
    with pytest.raises(KeyError, match="nope.*advantages"):
        batch["nope"]
    with pytest.raises(KeyError, match="nope"):
        batch.select(["nope"])
    with pytest.raises(KeyError, match="meta keys"):
        batch.select(["uid"], meta_keys=["missing"])


def test_select_pop_union_are_pure():
    batch = make_batch()
    before = to_bytes(batch)
    taken, rest = batch.pop(["advantages", "uid"])
    assert set(taken.keys()) == {"advantages", "uid"}
    assert set(rest.keys()) == {"responses", "response_mask", "reward_baselines", "raw_prompt"}
    assert taken.union(rest).equals(batch)
    assert to_bytes(batch) == before  # the input is untouched


def test_union_conflicts_are_errors():
    batch = make_batch()
    other = batch.assign(tensors={"advantages": batch["advantages"] + 1})
    with pytest.raises(ValueError, match="advantages"):
        batch.union(other)
    with pytest.raises(ValueError, match="uid"):
        batch.union(batch.assign(non_tensors={"uid": ["x"] * len(batch)}))
    with pytest.raises(ValueError, match="weight_version"):
        batch.union(batch.assign(meta={"weight_version": 4}))
    with pytest.raises(ValueError, match="sizes 6 and 3"):
        batch.union(batch[:3])


@pytest.mark.parametrize("size", [1, 2, 5, 6, 7])
@pytest.mark.parametrize("divisor", [1, 2, 3, 4])
def test_pad_chunk_concat_unpad_round_trip(size, divisor):
    batch = make_batch(size)
    padded, pad = batch.pad_to_divisor(divisor)
    assert len(padded) % divisor == 0 and pad == (-size) % divisor
    # Padding repeats real samples from the front, never zeros.
    assert rows(padded)[size:] == [rows(batch)[i % size] for i in range(pad)]
    chunks = padded.chunk(divisor)
    assert all(len(c) == len(padded) // divisor for c in chunks)
    assert Batch.concat(chunks).unpad(pad).equals(batch)


def test_chunk_that_does_not_divide_says_how_to_fix_it():
    with pytest.raises(ValueError, match=r"not divisible into 4 chunks.*pad_to_divisor"):
        make_batch(6).chunk(4)


def test_split_matches_slices():
    batch = make_batch(7)
    parts = batch.split(3)
    assert [len(p) for p in parts] == [3, 3, 1]
    assert Batch.concat(parts).equals(batch)


@pytest.mark.parametrize("interleave", [True, False])
def test_repeat_matches_loop(interleave):
    batch = make_batch(4)
    out = batch.repeat(3, interleave=interleave)
    samples = rows(batch)
    expected = [s for s in samples for _ in range(3)] if interleave else samples * 3
    assert rows(out) == expected


def test_reorder_and_boolean_index_match_loop():
    batch = make_batch(6)
    perm = torch.tensor([5, 2, 0, 4, 1, 3])
    assert rows(batch.reorder(perm)) == [rows(batch)[i] for i in perm.tolist()]
    keep = torch.tensor([True, False, True, True, False, False])
    assert rows(batch[keep]) == [r for r, k in zip(rows(batch), keep.tolist(), strict=False) if k]
    with pytest.raises(IndexError):
        batch.reorder([0, 9])


def test_sample_access_and_iteration_agree():
    batch = make_batch(4)
    for i, sample in enumerate(batch):
        assert torch.equal(sample["advantages"], batch["advantages"][i])
        assert sample["uid"] == batch.sample(i)["uid"] == batch[i]["uid"]


def test_concat_checks_fields_and_meta():
    a, b = make_batch(2), make_batch(3, seed=1)
    with pytest.raises(ValueError, match="fields"):
        Batch.concat([a, b.select(["uid"])])
    with pytest.raises(ValueError, match="weight_version"):
        Batch.concat([a, b.assign(meta={"weight_version": 9})])


def test_to_device_keeps_values():
    batch = make_batch()
    assert batch.to("cpu").equals(batch)


def test_group_ids_from_uids_first_seen_order():
    assert group_ids_from_uids(["b", "b", "a", "c", "a"]).tolist() == [0, 0, 1, 2, 1]


def test_object_columns_keep_lists_as_objects():
    batch = Batch(non_tensors={"tool_calls": [[1, 2], [3, 4]]})
    assert batch["tool_calls"].shape == (2,)
    assert batch[1]["tool_calls"] == [3, 4]
    assert np.array_equal(batch.repeat(2)["tool_calls"][2], [3, 4])
