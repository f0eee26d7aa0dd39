"""Batches through shared-memory files: exact, zero-copy on the receiving side, cleaned up,
and the same results through a worker group as pickled (two processes and Ray actors)."""

import os
from pathlib import Path

import pytest
import torch

from tandem.protocol import Batch
from tandem.protocol import shared as shared_module
from tandem.protocol.shared import BatchSharer, SharedBatch, read_probe, write_probe
from tests.controller.conftest import _echo_group


def _batch(rows: int = 64, width: int = 1024) -> Batch:
    generator = torch.Generator().manual_seed(rows)
    return Batch(
        {
            "x": torch.randn(rows, width, generator=generator),
            "ids": torch.randint(0, 1000, (rows, width), generator=generator),
            "half": torch.randn(rows, 3, generator=generator).to(torch.bfloat16),
            "flags": torch.rand(rows, 5, generator=generator) > 0.5,
        },
        non_tensors={"uid": [f"u{i}" for i in range(rows)]},
        meta={"step": 3, "note": "kept"},
    )


def _files(sharer: BatchSharer) -> list[Path]:
    return list(sharer.directory.glob(f"{sharer.prefix}-*"))


def test_round_trip_is_exact_and_the_file_name_goes_on_open():
    sharer = BatchSharer(min_bytes=0)
    batch = _batch()
    handle = sharer.share(batch)
    assert isinstance(handle, SharedBatch) and len(_files(sharer)) == 1
    opened = handle.open()
    assert opened.equals(batch)
    assert opened["half"].dtype == torch.bfloat16 and opened.meta == batch.meta
    assert not _files(sharer)  # the receiver removed the name; its views keep the pages
    with pytest.raises(FileNotFoundError, match="opened twice"):
        handle.open()


def test_opened_tensors_are_views_of_the_file():
    sharer = BatchSharer(min_bytes=0)
    handle = sharer.share(_batch(rows=8, width=16))
    other_mapping = torch.from_file(handle.path, shared=True, size=handle.nbytes, dtype=torch.uint8)
    opened = handle.open()
    before = other_mapping.clone()
    opened["x"].fill_(7.0)  # written through the receiver's view ...
    changed = (other_mapping != before).nonzero().flatten()
    assert len(changed) > 0  # ... shows in another mapping of the same file: no copy was made
    x_bytes = opened["x"].numel() * 4
    assert int(changed.max() - changed.min()) < x_bytes


def test_small_batches_and_a_full_directory_are_not_shared(monkeypatch):
    batch = _batch(rows=2, width=4)
    assert BatchSharer().share(batch) is batch  # below min_bytes
    monkeypatch.setattr(shared_module, "HEADROOM_BYTES", 1 << 62)
    sharer = BatchSharer(min_bytes=0)
    assert sharer.share(batch) is batch and not _files(sharer)


def test_unopened_files_are_discarded():
    sharer = BatchSharer(min_bytes=0)
    for _ in range(3):
        sharer.share(_batch(rows=4, width=8))
    assert sharer.discard_all() == 3 and not _files(sharer)


def test_probe():
    path, token = write_probe()
    try:
        assert read_probe(path, token)
        assert not read_probe(path, "another token")
    finally:
        os.unlink(path)
    assert not read_probe(path, token)


def test_worker_groups_take_large_batches_from_shared_memory(backend_world):
    backend, world = backend_world
    group = _echo_group(backend_world)
    try:
        batch = _batch(rows=96, width=2048)  # 2.3 MB of tensors
        out = group.double(batch)
        torch.testing.assert_close(out["y"], batch["x"] * 2)
        assert list(out["uid"]) == list(batch["uid"])
        if backend == "local" and world == 1:  # in-process: the object itself, nothing to share
            assert group.sharer is None
            return
        assert group.shared_memory_ranks() == set(range(world))
        assert group.sharer.files_written == world  # one shard each
        assert not _files(group.sharer)  # every worker opened (and unlinked) its file
        group._shared_ranks = set()  # as if no worker could see our /dev/shm: pickled, same answer
        pickled = group.double(batch)
        assert pickled.equals(out) and group.sharer.files_written == world
    finally:
        group.shutdown()
