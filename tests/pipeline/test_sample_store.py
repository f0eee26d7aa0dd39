"""The sample store: what a consumer reads is what the producer wrote, through the same pages."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tandem.pipeline.sample_store import SampleWriter, read_fields, release
from tests.conftest import ROOT


@pytest.fixture
def writer(tmp_path):
    return SampleWriter(str(tmp_path))


def test_fields_read_back_exactly_with_their_dtypes_and_shapes(writer):
    tensors = {
        "token_ids": torch.randint(0, 50_000, (37,)),
        "log_probs": torch.randn(37),
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "empty": torch.zeros(0, dtype=torch.int64),
    }
    ref = writer.write("g0", tensors)
    out = read_fields(ref)
    assert set(out) == set(tensors)
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name], tensor)
    assert set(read_fields(ref, ("log_probs",))) == {"log_probs"}


def test_a_consumer_maps_the_producers_pages_no_copy(writer):
    ref = writer.write("g1", {"a": torch.arange(8, dtype=torch.int64), "b": torch.ones(4)})
    first = read_fields(ref)
    second = read_fields(ref)
    first["a"][3] = 1000  # a write through one mapping shows in every other: the same memory
    assert int(second["a"][3]) == 1000
    # and the views sit inside the mapped file at the recorded offsets (no private buffer)
    spec = next(s for s in ref.fields if s.name == "b")
    assert second["b"].data_ptr() - second["a"].data_ptr() == spec.offset


def test_release_deletes_the_file_and_later_reads_say_so(writer):
    ref = writer.write("g2", {"a": torch.ones(3)})
    view = read_fields(ref)["a"]
    release(ref)
    assert not os.path.exists(ref.path)
    assert torch.equal(view, torch.ones(3))  # a mapping made before the release stays valid
    with pytest.raises(FileNotFoundError, match="g2"):
        read_fields(ref)


def test_unknown_fields_are_named(writer):
    ref = writer.write("g3", {"a": torch.ones(1)})
    with pytest.raises(KeyError, match=r"no fields \['nope'\]"):
        read_fields(ref, ("a", "nope"))


def test_discard_all_removes_only_this_writers_files(tmp_path):
    mine, other = SampleWriter(str(tmp_path)), SampleWriter(str(tmp_path))
    mine.write("x", {"a": torch.ones(1)})
    kept = other.write("y", {"a": torch.ones(1)})
    mine.discard_all()
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(kept.path)]


def test_a_missing_directory_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="nowhere"):
        SampleWriter(str(tmp_path / "nowhere"))


FILL_A_SMALL_TMPFS = """
import json, os, sys
import torch
from tandem.pipeline.sample_store import SampleStoreFullError, SampleWriter
directory = sys.argv[1]
writer = SampleWriter(directory)
first = writer.write("g0", {"token_ids": torch.ones(600_000 // 8, dtype=torch.int64)})
try:
    writer.write("g1", {"token_ids": torch.ones(600_000 // 8, dtype=torch.int64)})
    outcome = "written"
except SampleStoreFullError as error:
    outcome = str(error)
print(json.dumps({"outcome": outcome, "files": sorted(os.listdir(directory)), "first": os.path.basename(first.path)}))
"""


@pytest.mark.slow  # a fresh interpreter importing torch: about 5 s alone, 20 s on a loaded machine
def test_a_full_directory_is_an_error_naming_it_the_bytes_and_the_settings(tmp_path):
    """A 1 MiB tmpfs of its own (``unshare -m``, as tests/dataplane's second node): the second
    600 kB group does not fit. Unreserved pages would kill the writer with SIGBUS on first touch."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare -m and the right to mount a tmpfs (root)")
    small = tmp_path / "small"
    small.mkdir()
    script = tmp_path / "fill.py"
    script.write_text(FILL_A_SMALL_TMPFS)
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f'mount -t tmpfs -o size=1m tmpfs "{small}" && exec "{sys.executable}" "{script}" "{small}"'],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7: SIGBUS
    result = json.loads(done.stdout.strip().splitlines()[-1])
    message = result["outcome"]
    free = 1 << 20  # the tmpfs's pages less the first file's
    free -= 600_000 + (-600_000) % 4096
    assert f"{small} is full" in message and "need 600,000 bytes" in message
    assert f"{free:,} bytes are free" in message
    assert "pipeline.max_inflight_bytes" in message and "pipeline.sample_store=inline" in message
    assert result["files"] == [result["first"]]  # the refused group left no file behind
