"""The native engine's KV cache on the CPU takes memory as it is written: zeros like
``torch.zeros``, but resident only where the engine caches tokens, so a cache sized for the
worst case (256 slots x the longest sequence) no longer costs its whole size up front."""

import json
import subprocess
import sys

import torch

from tandem.device import zeros_on_use
from tandem.models import save_tiny_model
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, RolloutRequest, SamplingParams
from tandem.rollout.kv_cache import SlotKVCache
from tests.conftest import ROOT


def test_it_is_a_writable_zero_tensor_like_torch_zeros():
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        lazy, eager = zeros_on_use((3, 5, 7), dtype, "cpu"), torch.zeros((3, 5, 7), dtype=dtype)
        assert lazy.dtype == eager.dtype and lazy.shape == eager.shape and torch.equal(lazy, eager)
        lazy[1, 2] = 4
        eager[1, 2] = 4
        assert torch.equal(lazy, eager) and lazy.is_contiguous()
    assert zeros_on_use((0, 4), torch.float32, "cpu").shape == (0, 4)


RESIDENT = """
import json, sys, torch
from tandem.rollout.kv_cache import SlotKVCache

def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

before = resident_mb()
cache = SlotKVCache(4, 256, 2, 2048, 64, torch.float32, torch.device("cpu"))  # 2 GiB
allocated = resident_mb()
for slot in range(32):  # what an 8 x 4 step caches: 32 sequences of 96 tokens
    cache.write(slot, [torch.ones(2, 96, 64)] * 4, [torch.ones(2, 96, 64)] * 4)
decoded = cache.keys[0][:32, :, :2048].sum().item()  # a decode step reads past the written tokens
print(json.dumps({"nbytes": cache.nbytes, "allocated": allocated - before,
                  "used": resident_mb() - before, "sum": decoded}))
"""


def test_a_worst_case_cache_is_resident_only_where_it_is_written():
    done = subprocess.run(
        [sys.executable, "-c", RESIDENT], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["nbytes"] == 2 << 30
    assert result["allocated"] < 16  # MB: nothing is written at allocation
    assert result["used"] < 64  # MB: the 32 x 96 tokens' pages (reads of the rest stay unbacked)
    assert result["sum"] == 2 * 32 * 96 * 64


def test_the_engine_generates_the_same_with_an_eagerly_zeroed_cache(tmp_path, monkeypatch):
    """The reference: the same engine with its cache made by ``torch.zeros``."""
    model = str(save_tiny_model(tmp_path / "model"))
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=3)
    prompts = [[3, 5, 7, 9], [11, 13], [3, 5, 7, 9, 2, 4]] * 3
    outputs = []
    for eager in (False, True):
        if eager:
            monkeypatch.setattr(
                SlotKVCache, "allocate",
                lambda self: (
                    setattr(self, "keys", [torch.zeros(self.shape, dtype=self.dtype) for _ in range(self.num_layers)]),
                    setattr(self, "values", [torch.zeros(self.shape, dtype=self.dtype) for _ in range(self.num_layers)]),
                ),
            )  # fmt: skip
        engine = NativeRolloutEngine.from_pretrained(
            model, NativeEngineConfig(max_num_seqs=8, max_model_len=64)
        )
        try:
            requests = [RolloutRequest(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]
            outputs.append([(c.token_ids, c.log_probs) for c in engine.generate_batch(requests, timeout=120)])
        finally:
            engine.close()
    assert outputs[0] == outputs[1]
