"""Buckets: every dtype and shape comes back bit-exact from its place in a flat buffer."""

import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from tandem.checkpoint_engine import CheckpointEngineConfig, SenderAddress, WeightReceiver, WeightSender
from tandem.checkpoint_engine.buckets import ALIGN, BucketMeta, group_tensors, layout, pack, unpack


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(7, 5, generator=gen)),
        ("b.bias", torch.randn(3, generator=gen).to(torch.bfloat16)),
        ("c.transposed", torch.randn(4, 6, generator=gen).t()),  # not contiguous
        ("d.count", torch.tensor(12345678901, dtype=torch.int64)),  # 0-d
        ("e.empty", torch.empty(0, 4)),
        ("f.half", torch.randn(2, 3, 3, generator=gen).half()),
        ("g.big", torch.randn(300, generator=gen, dtype=torch.float64)),  # over the limit: alone
    ]


def test_grouping_respects_the_limit_and_a_larger_tensor_travels_alone():
    groups = list(group_tensors(_tensors(), limit=256))
    assert [name for group in groups for name, _ in group] == [name for name, _ in _tensors()]
    for group in groups:
        size = layout(group)[1]
        assert size <= 256 or len(group) == 1
    assert [name for name, _ in groups[-1]] == ["g.big"]


def test_pack_then_unpack_is_bit_exact_and_aligned():
    tensors = _tensors()
    specs, nbytes = layout(tensors)
    assert all(spec.offset % ALIGN == 0 for spec in specs)
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    pack(buffer, tensors, specs)
    meta = BucketMeta.from_json(BucketMeta(0, nbytes, specs).to_json())
    out = list(unpack(buffer, meta))
    for (name, original), (got_name, got) in zip(tensors, out, strict=True):
        assert got_name == name and got.dtype == original.dtype and got.shape == original.shape
        assert torch.equal(got, original)
        assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view, no copy


@pytest.mark.parametrize("backend", ["broadcast", "shared_memory", "files"])
def test_sender_and_receivers_in_threads_move_two_versions_exactly(backend, tmp_path):
    config = CheckpointEngineConfig(
        backend=backend, bucket_mb=256 / 2**20, directory=str(tmp_path), timeout_s=30
    )
    sender = WeightSender(config, receivers=2, device=torch.device("cpu"))
    results: dict[int, list] = {1: [], 2: []}

    def receive(index):
        receiver = WeightReceiver(config, sender.address, index, torch.device("cpu"))
        for version in (1, 2):
            results[index].append([(n, t.clone()) for n, t in receiver.receive(version)])
        receiver.close()

    threads = [threading.Thread(target=receive, args=(i,)) for i in (1, 2)]
    for thread in threads:
        thread.start()
    sender.connect()
    stats = [sender.send(_tensors(), 1), sender.send([(n, t * 2) for n, t in _tensors()], 2)]
    for thread in threads:
        thread.join(timeout=30)
    sender.close()
    assert stats[0].buckets > 2 and stats[0].bytes == stats[1].bytes > 0
    for index in (1, 2):
        for version, received in zip((1, 2), results[index], strict=True):
            expected = _tensors() if version == 1 else [(n, t * 2) for n, t in _tensors()]
            assert [n for n, _ in received] == [n for n, _ in expected]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(received, expected, strict=True))
    assert not any(p.name.startswith("tandem-weights") for p in tmp_path.iterdir())  # files cleaned up


def test_a_receiver_that_never_comes_is_named_in_the_timeout(tmp_path):
    config = CheckpointEngineConfig(backend="files", bucket_mb=1, directory=str(tmp_path), timeout_s=1)
    sender = WeightSender(config, receivers=1, device=torch.device("cpu"))
    sender.connect()
    with pytest.raises(
        TimeoutError, match=r"waited 1 s for receivers to acknowledge bucket 0 of weight version 1"
    ):
        sender.send(_tensors(), 1)
    sender.close()


def test_naive_and_files_without_a_directory_are_refused_with_the_key():
    with pytest.raises(ValueError, match="checkpoint_engine.directory is required with backend=files"):
        CheckpointEngineConfig(backend="files")
    with pytest.raises(ValueError, match="naive copies into a rollout engine in the same process"):
        WeightSender(CheckpointEngineConfig(), receivers=1, device=torch.device("cpu"))


def test_a_sender_that_exits_under_a_waiting_receiver_is_a_connection_error(tmp_path):
    script = textwrap.dedent(
        f"""
        import json, sys, torch
        from tandem.checkpoint_engine import CheckpointEngineConfig, WeightSender
        sender = WeightSender(CheckpointEngineConfig(backend="files", directory={str(tmp_path)!r}), 1, torch.device("cpu"))
        print(json.dumps([sender.address.host, sender.address.port]), flush=True)
        sys.stdin.readline()  # exits when the test says so, without sending anything
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    host, port = json.loads(process.stdout.readline())
    config = CheckpointEngineConfig(backend="files", directory=str(tmp_path), timeout_s=30)
    receiver = WeightReceiver(config, SenderAddress(host, port, "files", 1, "gloo"), 1, torch.device("cpu"))
    threading.Timer(0.5, lambda: process.stdin.close()).start()
    started = time.monotonic()
    with pytest.raises(
        ConnectionError, match=rf"lost the control plane at {host}:{port} while waiting for the sender"
    ):
        list(receiver.receive(1))
    assert time.monotonic() - started < 15
    process.wait(timeout=30)
