"""``@register(reads=..., outputs=...)``: checked when declared, and honoured by an in-process group
(the fast sibling of test_worker_group.py's process group)."""

from pathlib import Path

import pytest

from tandem.controller import ResourcePool, create_worker_group, register
from tandem.dataplane import BatchRef, ShmStore, get, traffic
from tandem.protocol import Batch
from tests.dataplane.conftest import padded_batch, stored_nbytes
from tests.dataplane.workers import READS, StageWorker


def test_bad_declarations_name_the_argument():
    with pytest.raises(ValueError, match="register\\(reads='input_ids'\\) must be a tuple of field names"):
        register(reads="input_ids")
    with pytest.raises(ValueError, match="register\\(outputs='kept'\\) is not allowed; choose one of"):
        register(outputs="kept")


def test_an_in_process_worker_fetches_its_declared_fields_and_keeps_its_outputs(tmp_path):
    batch = padded_batch(rows=5, seed=7)
    store = ShmStore(str(tmp_path))
    ref = BatchRef.put(batch, store)
    with create_worker_group(StageWorker, ResourcePool((1,)), "local") as group:
        expected = group.forward(batch)
        before = traffic()
        assert group.forward(ref).equals(expected)
        stored = [f for f in READS if f in ref.schema]
        assert (traffic() - before).fetched_bytes == stored_nbytes(batch, stored, range(5))
        kept = group.forward_kept(ref)
        assert isinstance(kept, BatchRef) and kept.stored_fields() == ["old_log_probs"]
        assert kept.materialise(get).equals(expected)
        # a Batch argument reaches the method whole, as before; a BatchRef as its declared fields
        assert group.fields_seen() == [[sorted(batch.keys()), sorted(READS), sorted(READS)]]
        group.release_refs(kept)
        assert not any(Path(block.path).exists() for block in kept.blocks())
    store.release(ref.blocks()[0])


def test_a_kept_output_method_called_with_a_batch_returns_its_batch():
    """``outputs="ref"`` only matters when a BatchRef reaches the method: called with a Batch (the
    trainers' path with the data plane off), the output travels back as a Batch, as before."""
    batch = padded_batch(rows=5, seed=3)
    with create_worker_group(StageWorker, ResourcePool((1,)), "local") as group:
        expected = group.forward(batch)
        got = group.forward_kept(batch)
        assert isinstance(got, Batch) and got.equals(expected)
