"""A real process group of two ranks called with a BatchRef: the same outputs as with the Batch;
each rank fetches exactly its declared fields of its rows; kept outputs chain to the next stage
without the controller serialising or rebuilding a byte of payload; release leaves no file."""

import os
from pathlib import Path

import pytest

from tandem.controller import ResourcePool, create_worker_group
from tandem.dataplane import BatchRef, ShmStore, get
from tandem.dataplane.shm import PREFIX
from tandem.protocol.traffic import batch_traffic
from tests.dataplane.conftest import padded_batch, stored_index_bytes, stored_nbytes
from tests.dataplane.workers import READS, StageWorker


@pytest.fixture(scope="module")
def group():
    group = create_worker_group(StageWorker, ResourcePool((2,), cpus_per_process=1), "process")
    yield group
    group.shutdown()


def block_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"{PREFIX}-*")}


def test_a_ref_argument_gives_the_batch_arguments_outputs_and_each_rank_fetches_its_rows(group):
    batch = padded_batch(rows=7)
    store = ShmStore()
    ref = BatchRef.put(batch, store)
    expected = group.forward(batch)  # today's path: the whole batch to each rank
    group.fields_seen()

    before = group.data_traffic()
    got = group.forward(ref)
    fetched = [(after - earlier) for after, earlier in zip(group.data_traffic(), before, strict=True)]
    assert got.equals(expected)
    assert group.fields_seen() == [[sorted(READS)]] * 2  # only the declared fields reached the method

    stored = [f for f in READS if f in ref.schema]
    rank_rows = [[0, 1, 2, 3], [4, 5, 6, 0]]  # 7 rows padded to 8 by repeating row 0
    for rank, rows in enumerate(rank_rows):
        assert fetched[rank].fetched_bytes == stored_nbytes(batch, stored, rows), rank
        assert fetched[rank].fetched_index_bytes == stored_index_bytes(batch, stored, rows)
    store.release(ref.blocks()[0])


def test_mesh_dispatch_splits_refs_by_dp_rank(group):
    batch = padded_batch(rows=6, seed=3)
    store = ShmStore()
    group.declare_reversed_mesh()
    ref = BatchRef.put(batch, store)
    assert group.forward_on_mesh(ref).equals(group.forward_on_mesh(batch))
    store.release(ref.blocks()[0])


def test_kept_outputs_chain_without_payload_through_the_controller_and_release_cleans_up(group):
    batch = padded_batch(rows=7, seed=5)
    today = group.loss_kept(batch.union(group.forward(batch)))  # Batch arguments: a Batch back
    store = ShmStore()
    files_before = block_files()
    ref = BatchRef.put(batch, store)

    before = batch_traffic()
    kept = group.forward_kept(ref)  # old_log_probs stay in the ranks' stores
    losses = group.loss_kept(ref.union(kept))
    handled = batch_traffic() - before
    assert handled.serialised == 0 and handled.deserialised == 0  # payload bytes the controller handled
    assert isinstance(kept, BatchRef) and kept.stored_fields() == ["old_log_probs"]
    assert list(kept["uid_seen"]) == list(batch["uid"])  # the per-row Python column came back inline

    assert losses.materialise(get).equals(today)
    assert kept.materialise(get, ["old_log_probs"]).equals(group.forward(batch).select(["old_log_probs"]))
    assert losses.stored_fields() == [] and "loss_terms" in losses  # a per-row scalar: held inline
    assert (
        len(kept.blocks()) == 2 and len(block_files() - files_before) == 1 + 2
    )  # the input, a block per rank

    for refs in (ref, kept, losses):
        group.release_refs(refs)
    assert block_files() <= files_before
    assert not any(f"{PREFIX}-{os.getpid()}-" in name for name in block_files())
    assert sum(t.blocks_released for t in group.data_traffic()) >= 3
