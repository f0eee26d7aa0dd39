"""The GPU tier for the native engine's CUDA-graph decode: replayed graphs against the plain
eager decode on the same GPU (fp32: same tokens, log-probs within 1e-4), graphs that are
dropped on sleep and recaptured after wake (bf16), and a capture that fails. Skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch

from tandem.models import TinyModelConfig, save_tiny_model
from tandem.rollout.decode_graphs import DecodeGraphs
from tests.rollout.test_decode_graphs import (
    check_sleep_drops_the_graphs_and_wake_repeats_the_tokens,
    mixed_requests,
)
from tests.rollout.test_native_engine import native

pytestmark = pytest.mark.gpu

SETTINGS = dict(max_num_seqs=24, max_model_len=300, max_prefill_tokens=200, device="cuda")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("graphs") / "qwen2", TinyModelConfig(family="qwen2", seed=5)))


def test_cuda_graph_decode_equals_the_eager_decode(model_dir):
    requests = mixed_requests(40)
    eager = native(model_dir, cuda_graphs=False, **SETTINGS)
    graphed = native(model_dir, **SETTINGS)
    try:
        assert eager.decode_graphs is None and graphed.decode_graphs is not None
        want = eager.generate_batch(requests, timeout=300)
        got = graphed.generate_batch(requests, timeout=300)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-4, rtol=0)
        assert graphed.decode_graphs.captures == len(graphed.decode_graphs) > 2
        assert graphed.stats.graph_steps > 0.8 * graphed.stats.steps
    finally:
        eager.close()
        graphed.close()


def test_bf16_graphs_are_recaptured_after_sleep_and_give_the_same_tokens(model_dir):
    engine = native(model_dir, dtype="bfloat16", **SETTINGS)
    check_sleep_drops_the_graphs_and_wake_repeats_the_tokens(engine, 12)
    # every bucket of the second round was recorded again after the wake
    assert engine.decode_graphs.captures == 2 * len(engine.decode_graphs) > 0


def test_a_capture_that_reads_back_falls_back_to_eager_and_leaves_cuda_usable(model_dir, monkeypatch):
    """A step that syncs with the host cannot be captured: the capture fails, the step runs
    eagerly, this thread gets its stream back, and a later capture (another instance) works."""
    engine = native(model_dir, **SETTINGS)
    forward = DecodeGraphs._forward

    def reading_back(self, entry, length):
        hidden = forward(self, entry, length)
        if torch.cuda.is_current_stream_capturing():
            hidden.sum().item()  # a device-to-host read: not allowed while capturing
        return hidden

    try:
        with torch.inference_mode():
            ids = torch.tensor([5, 6, 7], device="cuda")
            positions = torch.zeros(3, dtype=torch.long, device="cuda")
            monkeypatch.setattr(DecodeGraphs, "_forward", reading_back)
            failed = engine.decode_graphs
            hidden = failed.run(ids, positions, 1).clone()
            assert failed.failure and not failed.use_cuda_graphs and failed.captures == 0
            assert torch.cuda.current_stream() == torch.cuda.default_stream()
            monkeypatch.undo()
            fresh = DecodeGraphs(engine.lean_decoder, engine.cache)
            torch.testing.assert_close(fresh.run(ids, positions, 1), hidden)
            assert fresh.captures == 1
    finally:
        engine.close()
