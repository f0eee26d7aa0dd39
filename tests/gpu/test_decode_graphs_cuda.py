"""The GPU tier for the native engine's CUDA-graph decode: replayed graphs against the plain
eager decode on the same GPU (fp32: same tokens, log-probs within 1e-4), and graphs that are
dropped on sleep and recaptured after wake (bf16). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tandem.models import TinyModelConfig, save_tiny_model
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
