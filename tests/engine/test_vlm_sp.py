"""A vision-language model under Ulysses sequence parallelism: the merged embeddings and M-RoPE
positions are sharded along the packed row like its tokens, the vision tower runs on every rank.

The slow test runs two gloo ranks (sp=2) against one process on the tiny VLM (fp32): loss,
log-probs and every gradient, the vision tower's included. The fast one checks the sharding
itself: each rank's shard of the decoder's inputs is the slice of the whole row's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.engine.forward_request import ForwardRequest
from tandem.engine.token_model import decoder_hidden_states
from tandem.engine.ulysses import SequenceParallel
from tandem.engine.ulysses_attention import SEQUENCE_PARALLEL_KEYWORD
from tandem.engine.varlen_attention import PLAN_KEYWORD
from tests.engine.mesh_comparisons import assert_same_gradients, mesh_groups
from tests.engine.test_vlm_engine import mixed_prompts, qwen2_vl_dir, vlm_batch  # noqa: F401 (fixture)
from tests.engine.ulysses_workers import UlyssesWorker

one_process, two_ranks, gpu_groups = mesh_groups(UlyssesWorker, "sequence-parallel")


class _Recorder(torch.nn.Module):
    """A decoder that records what it is handed and returns its embeddings as hidden states."""

    def forward(self, **kwargs):
        self.seen = kwargs
        return type("Out", (), {"last_hidden_state": kwargs["inputs_embeds"]})()


def test_each_rank_gets_its_slice_of_the_merged_embeddings_and_mrope_positions():
    length, hidden = 12, 5
    embeds = torch.randn(1, length, hidden)
    rope = torch.arange(3 * length).view(3, 1, length)
    plan = object()  # passed through untouched
    for rank in range(2):
        request = ForwardRequest(
            input_ids=torch.zeros(1, length, dtype=torch.long),
            position_ids=torch.zeros(1, length, dtype=torch.long),
            attention_plan=plan,
            sequence_parallel=SequenceParallel(None, 2, rank),
        )
        decoder = _Recorder()
        states = decoder_hidden_states(decoder, request, {"inputs_embeds": embeds, "position_ids": rope})
        half = slice(rank * 6, (rank + 1) * 6)
        assert torch.equal(states, embeds[:, half])
        assert torch.equal(decoder.seen["position_ids"], rope[:, :, half])
        assert decoder.seen[PLAN_KEYWORD] is plan
        assert decoder.seen[SEQUENCE_PARALLEL_KEYWORD] is request.sequence_parallel


def _config(path: str, **overrides):
    from tandem.engine import EngineConfig

    base = EngineConfig(
        model_path=path, lr=1e-3, eps=1e-3, max_tokens_per_micro_batch=400, pad_tokens_to_multiple=1
    )
    return dataclasses.replace(base, **overrides)


@pytest.mark.slow
def test_two_sequence_parallel_ranks_on_a_vlm_equal_one_process(qwen2_vl_dir, one_process, two_ranks):  # noqa: F811
    batch = vlm_batch(qwen2_vl_dir, mixed_prompts(qwen2_vl_dir), [6, 3, 5, 4])
    config = _config(qwen2_vl_dir)
    one_process.build(config)
    whole = one_process.gradients(batch)[0]
    assert any("visual" in name for name in whole["grads"])
    two_ranks.build(dataclasses.replace(config, sp_size=2, strategy="ddp"))
    split = two_ranks.gradients(batch)
    assert_same_gradients(split, whole)
