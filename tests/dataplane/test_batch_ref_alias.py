"""``BatchRef.alias``: a stored field exposed under a second name by metadata only (the rename of
``pipeline.old_log_probs=rollout``). Every op on the aliased refs, materialised, equals the same
op on the materialised Batch renamed as the ``Batch`` path renames it, bit for bit; the fetch asks
the block for the stored field once, and the blocks are released once."""

import pickle

import pytest
import torch

from tandem.dataplane import BatchRef, ShmStore, get, release, traffic
from tandem.protocol import Batch
from tests.dataplane.conftest import padded_batch
from tests.dataplane.test_batch_ref import OPS

ALIAS = {"old_log_probs": "rollout_log_probs"}


def renamed(batch: Batch) -> Batch:
    """What ``rollout_old_log_probs`` does on the ``Batch`` path."""
    return batch.assign(tensors={"old_log_probs": batch["rollout_log_probs"]})


@pytest.fixture
def store(tmp_path):
    return ShmStore(str(tmp_path))


FIELD_OPS = {
    "select_alias_only": lambda b: b.select(["old_log_probs", "uid"]),
    "select_both": lambda b: b.select(["rollout_log_probs", "old_log_probs", "responses"]),
    "select_then_index": lambda b: b.select(["old_log_probs", "response_mask"])[[4, 4, 0]],
}


@pytest.mark.parametrize("name", [*OPS, *FIELD_OPS])
def test_each_op_on_the_aliased_refs_equals_the_op_on_the_renamed_batch(store, batch, name):
    op = {**OPS, **FIELD_OPS}[name]
    if name == "select":  # OPS' select, with the alias beside its stored field
        op = lambda b: b.select(["input_ids", "uid", "rollout_log_probs", "old_log_probs"])  # noqa: E731
    ref = BatchRef.put(batch, store)
    before = traffic()
    result = op(ref.alias(ALIAS))
    assert (traffic() - before).fetched_bytes == 0  # metadata only
    assert isinstance(result, BatchRef) and "old_log_probs" in result.stored_fields()
    assert result.materialise(get).equals(op(renamed(batch)))


def test_an_alias_is_fetched_once_under_its_stored_name(store, batch):
    ref = BatchRef.put(batch, store).alias(ALIAS)
    before = traffic()
    ref.materialise(get, ["rollout_log_probs"])
    once = traffic() - before
    before = traffic()
    both = ref[[1, 3, 3]].materialise(get, ["old_log_probs", "rollout_log_probs"])
    twice = traffic() - before
    assert set(once.fetched_by_field) == set(twice.fetched_by_field) == {"rollout_log_probs"}
    assert twice.fetched_bytes <= once.fetched_bytes  # the alias costs no byte more (fewer rows here)
    only_alias = traffic()
    got = ref.materialise(get, ["old_log_probs"])
    assert (traffic() - only_alias).fetched_by_field == once.fetched_by_field
    assert got.equals(renamed(batch).select(["old_log_probs"]))
    assert both.equals(renamed(batch)[[1, 3, 3]].select(["old_log_probs", "rollout_log_probs"]))


def test_aliased_refs_concat_crop_union_and_pickle_like_the_renamed_batch(store):
    one, two = padded_batch(seed=1), padded_batch(seed=2)
    refs = [BatchRef.put(b, store).alias(ALIAS) for b in (one, two)]
    joined = BatchRef.concat([refs[0][1:4], refs[1], refs[0][:1]])
    expected = Batch.concat([renamed(one)[1:4], renamed(two), renamed(one)[:1]])
    assert joined.materialise(get).equals(expected)
    cropped = joined.crop({"old_log_probs": (0, 1, 4)})  # the alias cut, its stored field not
    got = cropped.materialise(get, ["old_log_probs", "rollout_log_probs"])
    assert torch.equal(got["old_log_probs"], expected["old_log_probs"][:, 1:4])
    assert torch.equal(got["rollout_log_probs"], expected["rollout_log_probs"])
    outputs = Batch({"advantages": torch.randn(len(joined), 6)})
    unioned = joined.select(["old_log_probs", "uid"]).union(BatchRef.put(outputs, store))
    assert unioned.materialise(get).equals(expected.select(["old_log_probs", "uid"]).union(outputs))
    copy = pickle.loads(pickle.dumps(joined[[5, 0]]))
    assert copy.materialise(get).equals(expected[[5, 0]])
    with pytest.raises(ValueError, match="concat: batch 1 stores"):  # aliased and not: two layouts
        BatchRef.concat([refs[0], BatchRef.put(two, store)])


def test_a_block_referenced_under_two_names_is_released_once(store, batch):
    ref = BatchRef.put(batch, store)
    aliased = ref.alias(ALIAS)
    both = aliased.select(["rollout_log_probs", "uid"]).union(aliased.select(["old_log_probs", "responses"]))
    assert aliased.blocks() == ref.blocks() and pickle.loads(pickle.dumps(both)).blocks() == ref.blocks()
    released = []
    pickle.loads(pickle.dumps(both)).release(released.append)
    assert released == ref.blocks()
    before = traffic()
    both.release(release)
    assert (traffic() - before).blocks_released == 1


def test_bad_aliases_are_refused(store, batch):
    ref = BatchRef.put(batch, store)
    with pytest.raises(ValueError, match="'responses' is already a field"):
        ref.alias({"responses": "rollout_log_probs"})
    with pytest.raises(KeyError, match="'uid' is not a stored field"):
        ref.alias({"uids": "uid"})
    with pytest.raises(KeyError, match="'old_log_probs' is not a stored field"):
        ref.alias({"teacher": "old_log_probs"})
