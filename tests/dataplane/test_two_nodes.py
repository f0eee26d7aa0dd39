"""Two Ray nodes on this machine, the second with a /dev/shm of its own (two_nodes_run.py): a
rank on each node fetches the other node's block through Ray's object store, bit-exact, the
exact bytes of its rows' declared fields, while the controller serialises and fetches nothing."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow  # two raylets start in about a minute on a loaded 2-core machine
def test_ranks_on_two_nodes_with_private_shm_fetch_each_others_blocks_through_ray():
    pytest.importorskip("ray")
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare -m and the right to mount a tmpfs (root)")
    done = subprocess.run(
        [sys.executable, "-m", "tests.dataplane.two_nodes_run"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])

    places = result["places"]
    assert sorted(p["ip"] for p in places) == ["127.0.0.2", "127.0.0.3"]
    assert places[0]["shm_device"] != places[1]["shm_device"]  # two /dev/shm mounts
    assert result["visible"] == [[True, False], [False, True]]  # neither sees the other's files
    assert result["block_nodes"] == [p["node"] for p in places]  # each rank's output stayed on its node
    assert result["engines"] == ["ray"]
    assert result["exact"]  # fetched across nodes, bit for bit
    assert result["fetched"] == result["expected_fetched"]  # the real tokens of its rows, nothing more
    assert result["controller_batch_bytes"] == 0 and result["controller_fetched_bytes"] == 0
