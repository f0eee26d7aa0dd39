"""vLLM's routing record turned into tandem's (no vLLM needed): vLLM returns, per finished request,
``[prompt + response - 1, decoder layers, k]`` (uint8) indexed by decoder layer, with a dense
layer's column left 0 (vllm/distributed/aux_output_connector, RoutedExpertsCapturer, 0.32);
tandem's record is ``[prompt + response, MoE layers, k]`` (int16, last row -1). The references
are the native engine's records of the same models, one of them with a dense layer between
MoE layers. vLLM itself records only on a GPU: tests/rollout/test_vllm_moe.py."""

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tandem.models import TinyModelConfig, load_model, save_tiny_model
from tandem.models.moe import NOT_ROUTED, moe_layer_indices, moe_routers
from tandem.rollout.routing import routing_from_decoder_layers
from tandem.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine, _moe_layout
from tests.rollout.test_moe_rollout import generate
from tests.rollout.test_native_engine import random_prompts


def save_moe_with_dense_layer(path, family: str) -> str:
    """A tiny 3-layer MoE model whose layer 1 is dense (``mlp_only_layers=[1]``)."""
    save_tiny_model(path, TinyModelConfig(family=family, num_layers=3, seed=3))
    config = AutoConfig.from_pretrained(path)
    config.mlp_only_layers = [1]
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe"])
def mixed_dir(request, tmp_path_factory):
    return save_moe_with_dense_layer(tmp_path_factory.mktemp(request.param) / "model", request.param)


def vllm_record(routed: torch.Tensor, moe_layers: list[int], decoder_layers: int) -> np.ndarray:
    """What vLLM returns for a request whose tokens were routed as ``routed [T, L, k]`` (tandem's
    record): one row per fed token (all but the last), a column per decoder layer, dense ones 0."""
    rows = np.zeros((routed.shape[0] - 1, decoder_layers, routed.shape[2]), dtype=np.uint8)
    rows[:, moe_layers] = routed[:-1].numpy()
    return rows


def test_moe_layers_are_the_trainers_routers_in_decoder_order(mixed_dir):
    model = load_model(mixed_dir)
    assert moe_layer_indices(model) == [0, 2]
    assert len(moe_routers(model)) == 2
    assert _moe_layout(AutoConfig.from_pretrained(mixed_dir)) == ([0, 2], 2)  # from the meta model


def test_vllm_record_converts_to_the_native_engines_routing(mixed_dir):
    """Each completion's record in vLLM's layout converts back to the native engine's exactly,
    the dense layer's column dropped and the last token's row -1."""
    prompts = random_prompts(4, 5, high=20)
    completions = generate(mixed_dir, prompts, temperature=0.0, max_tokens=8)
    for completion in completions:
        routed = completion.routed_experts
        total = len(completion.prompt_ids) + len(completion.token_ids)
        assert routed.shape == (total, 2, 2) and (routed[-1] == NOT_ROUTED).all()
        rows = vllm_record(routed, [0, 2], 3)
        converted = routing_from_decoder_layers(rows, total, [0, 2], 2)
        assert converted.dtype == torch.int16
        assert torch.equal(converted, routed)
        # vLLM fed the last token in (it generated past a stop string tandem found): still -1
        past = np.concatenate([rows, rows[-1:]])
        assert torch.equal(routing_from_decoder_layers(past, total, [0, 2], 2), routed)


def test_missing_rows_route_live_and_a_wrong_shape_is_refused():
    assert (routing_from_decoder_layers(None, 5, [0, 2], 2) == NOT_ROUTED).all()
    short = routing_from_decoder_layers(np.ones((2, 3, 2), dtype=np.uint8), 5, [0, 2], 2)
    assert (short[:2] == 1).all() and (short[2:] == NOT_ROUTED).all()
    with pytest.raises(ValueError, match=r"decoder layers > 2, k=2\], got \(4, 2, 2\)"):
        routing_from_decoder_layers(np.ones((4, 2, 2), dtype=np.uint8), 5, [0, 2], 2)


def test_recording_a_dense_model_is_refused_naming_the_key(tmp_path):
    path = save_tiny_model(tmp_path / "dense", TinyModelConfig(family="qwen2"))
    with pytest.raises(
        ValueError, match=r"vllm.record_routing=True: Qwen2ForCausalLM has no mixture-of-experts"
    ):
        VLLMRolloutEngine(str(path), VLLMEngineConfig(record_routing=True))  # refused before vLLM starts
