"""Every BatchRef op, materialised, equals the same op on the materialised Batch bit for bit,
and none of them reads the store (the store's fetch counter stays still until materialise)."""

import pickle

import pytest
import torch

from tandem.dataplane import BatchRef, ShmStore, get, traffic
from tandem.protocol import Batch
from tests.dataplane.conftest import padded_batch

OPS = {
    "slice": lambda b: b[2:6],
    "index": lambda b: b[torch.tensor([6, 0, 3, 3])],
    "negative_index": lambda b: b[[-1, 0]],
    "mask": lambda b: b[torch.tensor([True, False, True, False, False, True, True])],
    "reorder": lambda b: b.reorder([3, 1, 0, 2, 6, 5, 4]),
    "select": lambda b: b.select(["input_ids", "uid", "rollout_log_probs"]),
    "chunk": lambda b: b.pad_to_divisor(4)[0].chunk(4)[3],
    "split": lambda b: b.split(3)[-1],
    "repeat": lambda b: b.repeat(2),
    "tile": lambda b: b.repeat(2, interleave=False),
    "pad": lambda b: b.pad_to_divisor(3)[0],
    "pad_unpad": lambda b: b.pad_to_divisor(3)[0].unpad(2),
    "concat_self": lambda b: type(b).concat([b[4:], b[:2], b[1:3]]),
}


@pytest.fixture
def store(tmp_path):
    return ShmStore(str(tmp_path))


@pytest.mark.parametrize("name", list(OPS))
def test_each_op_on_the_refs_equals_the_op_on_the_batch(store, batch, name):
    ref = BatchRef.put(batch, store)
    before = traffic()
    result = OPS[name](ref)
    assert (traffic() - before).fetched_bytes == 0  # the op rewrote indices only
    assert isinstance(result, BatchRef)
    assert result.materialise(get).equals(OPS[name](batch))


def test_concat_of_blocks_and_union_of_parts_equal_the_batch_ops(store):
    one, two = padded_batch(seed=1), padded_batch(seed=2)
    ref_one, ref_two = BatchRef.put(one, store), BatchRef.put(two, store)
    mixed = BatchRef.concat([ref_one[1:4], ref_two, ref_one[:1]]).reorder(list(range(10, -1, -1)))
    expected = Batch.concat([one[1:4], two, one[:1]]).reorder(list(range(10, -1, -1)))
    assert mixed.materialise(get).equals(expected)
    assert len(mixed.blocks()) == 2

    outputs = Batch({"old_log_probs": torch.randn(7, 6)})
    joined = ref_one.select(["input_ids", "uid"]).union(BatchRef.put(outputs, store))[[5, 1]]
    expected = one.select(["input_ids", "uid"]).union(outputs)[[5, 1]]
    assert joined.materialise(get).equals(expected)
    assert joined.materialise(get, ["old_log_probs"]).equals(expected.select(["old_log_probs"]))


def test_materialise_fetches_each_row_once_and_only_the_asked_fields(store, batch):
    ref = BatchRef.put(batch, store)
    before = traffic()
    got = ref.repeat(3).materialise(get, ["responses"])
    assert got.equals(batch.repeat(3).select(["responses"]))
    once = traffic() - before
    before = traffic()
    ref.materialise(get, ["responses"])
    assert (traffic() - before).fetched_bytes == once.fetched_bytes  # repeats are not fetched again


def test_a_pickled_ref_carries_no_payload_and_no_batch(store, batch):
    from tandem.protocol.traffic import batch_traffic

    ref = BatchRef.put(batch, store)
    before = batch_traffic()
    copy = pickle.loads(pickle.dumps(ref))
    assert (batch_traffic() - before).total == 0
    assert copy.materialise(get).equals(batch)


def test_mismatched_refs_are_refused(store, batch):
    ref = BatchRef.put(batch, store)
    with pytest.raises(ValueError, match="concat: batch 1 stores"):
        BatchRef.concat([ref, ref.select(["input_ids", "uid", "data_source", "group_ids"])])
    with pytest.raises(ValueError, match="stored fields \\['input_ids'\\] are on both sides"):
        ref.select(["input_ids"]).union(ref.select(["input_ids"]))
    with pytest.raises(KeyError, match="is stored, not inline"):
        ref["input_ids"]
    with pytest.raises(ValueError, match="not divisible into 2 chunks"):
        ref.chunk(2)
