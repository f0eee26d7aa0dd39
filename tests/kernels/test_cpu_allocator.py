"""The malloc settings: freed tensor memory is recycled instead of faulted in again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.kernels.cpu import allocator as cpu_allocator

# Allocates and frees 16 touched 8 MiB tensors per round and counts the page faults of five
# rounds after two warm-up rounds. Each run is a fresh process: the settings are process-wide.
CHURN = """
import resource, torch
from tandem.kernels.cpu.allocator import tune_cpu_allocator
applied = tune_cpu_allocator()
def churn():
    blocks = [torch.ones(2 * 1024 * 1024) for _ in range(16)]
    del blocks
churn(); churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    churn()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES_PER_ROUND = 16 * 8 * 1024 * 1024 // 4096


def run_churn(tuning: str) -> tuple[bool, int]:
    env = {**os.environ, "TANDEM_MALLOC_TUNING": tuning, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CHURN], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_tuned_allocator_recycles_freed_tensor_memory():
    tuned, tuned_faults = run_churn("1")
    # Five rounds touch 5 x 32768 pages; tuned, the freed blocks are reused, so at most
    # about one round's pages fault. (Untuned, glibc's adaptive thresholds decide: usually
    # every round faults again, sometimes not, so that side is not asserted.)
    assert tuned
    assert tuned_faults <= PAGES_PER_ROUND
    switched_off, _ = run_churn("0")
    assert not switched_off


def test_bad_switch_value_is_named(monkeypatch):
    monkeypatch.setenv("TANDEM_MALLOC_TUNING", "yes")
    with pytest.raises(ValueError, match="TANDEM_MALLOC_TUNING='yes'"):
        cpu_allocator._apply()
