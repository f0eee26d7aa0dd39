"""Mixture-of-experts models on vLLM (slow tier: needs vLLM). vLLM's CPU build generates them, but
records no routing: that needs its Model Runner V2, which needs Triton, which the CPU build lacks.
The recording tests are therefore marked ``gpu`` as well (not run on a CPU-only machine).

Run in an environment holding vLLM: ``python -m pytest -m slow tests/rollout/test_vllm_moe.py``.
"""

import pytest
import torch

from tandem.models import TinyModelConfig, load_model, save_tiny_model
from tandem.models.moe import NOT_ROUTED, RouterTap
from tandem.rollout import RolloutRequest, SamplingParams
from tests.rollout.test_moe_rollout import generate
from tests.rollout.test_native_engine import greedy, random_prompts

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from vllm.triton_utils import HAS_TRITON  # noqa: E402

from tandem.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine  # noqa: E402

NEAR_TIE = 1e-3  # a (token, layer) whose k-th and (k+1)-th router probabilities are closer is near-tied


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe"])
def moe_dir(request, tmp_path_factory):
    config = TinyModelConfig(family=request.param, seed=3)
    return str(save_tiny_model(tmp_path_factory.mktemp(request.param) / "model", config))


def vllm_generate(path: str, requests, **config):
    engine = VLLMRolloutEngine(path, VLLMEngineConfig(max_model_len=128, max_num_seqs=16, **config))
    try:
        return engine.generate_batch(requests, timeout=300)
    finally:
        engine.close()


def live_routing(model, completion) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's own top-k over prompt + response, ``[T, L, k]`` sorted within k, and each
    (token, layer)'s gap between the k-th and (k+1)-th router probability ``[T, L]`` (fp32, CPU)."""
    tap = RouterTap(model)
    try:
        with torch.no_grad():
            model(torch.tensor([[*completion.prompt_ids, *completion.token_ids]]))
        experts = tap.recorded().long().sort(-1).values
        probs = torch.stack(
            [torch.softmax(tap.calls[layer].logits.float(), -1) for layer in range(tap.num_layers)], 1
        )
        top = probs.topk(tap.top_k + 1, dim=-1).values
        return experts, top[..., -2] - top[..., -1]
    finally:
        tap.remove()


def test_vllm_generates_moe_models_as_the_native_engine(moe_dir):
    """Without recording, vLLM's CPU build runs Qwen2-MoE and Qwen3-MoE: greedy tokens equal the
    native engine's, log-probs within vLLM's numerics."""
    prompts = random_prompts(8, 4, high=20)
    requests = [greedy(p, f"g{i}", max_tokens=12, ignore_eos=False) for i, p in enumerate(prompts)]
    ours = vllm_generate(moe_dir, requests)
    native = generate(moe_dir, prompts, temperature=0.0, max_tokens=12)
    assert [c.token_ids for c in ours] == [c.token_ids for c in native]
    assert all(c.routed_experts is None for c in ours)  # not asked for
    deltas = [
        abs(a - b)
        for o, n in zip(ours, native, strict=True)
        for a, b in zip(o.log_probs, n.log_probs, strict=True)
    ]
    assert max(deltas) < 1e-4


@pytest.mark.skipif(HAS_TRITON, reason="this vLLM has Triton, so it can record routing")
def test_recording_without_model_runner_v2_is_refused_naming_the_key(moe_dir):
    with pytest.raises(
        ValueError, match=r"(?s)vllm.record_routing=True: this vLLM cannot record .*Model Runner V2"
    ):
        VLLMRolloutEngine(moe_dir, VLLMEngineConfig(max_model_len=128, max_num_seqs=8, record_routing=True))


@pytest.mark.gpu
def test_recorded_routing_equals_the_trainers_live_routing(moe_dir):
    """vLLM's recorded experts (fp32) against the trainer's top-k over the same prompt + response:
    equal on every (token, layer) that is not near-tied, and on at least 99% of all of them; the
    prompt rows of a request whose prompt came from the prefix cache equal the first's."""
    prompts = random_prompts(12, 6, low=40, high=60)  # longer than a cache block (16 tokens)
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=None)
    requests = [RolloutRequest(f"s{i}", p, params) for i, p in enumerate(prompts)]
    repeat = [RolloutRequest("again", prompts[0], SamplingParams(temperature=1.0, max_tokens=8, seed=None))]
    engine = VLLMRolloutEngine(
        moe_dir, VLLMEngineConfig(max_model_len=128, max_num_seqs=16, record_routing=True)
    )
    try:
        completions = engine.generate_batch(requests, timeout=300)
        cached = engine.generate_batch(repeat, timeout=300)[0]  # the prompt's blocks are cached by now
    finally:
        engine.close()
    model = load_model(moe_dir)
    equal, total, tied_off = 0, 0, 0
    for completion in completions:
        routed = completion.routed_experts
        length = len(completion.prompt_ids) + len(completion.token_ids)
        assert routed.shape == (length, model.config.num_hidden_layers, 2) and routed.dtype == torch.int16
        assert (routed[:-1] >= 0).all() and (routed[-1] == NOT_ROUTED).all()
        live, gaps = live_routing(model, completion)
        same = (routed[:-1].long().sort(-1).values == live[:-1]).all(-1)
        clear = gaps[:-1] >= NEAR_TIE
        assert same[clear].all()
        equal, total, tied_off = (
            equal + int(same.sum()),
            total + same.numel(),
            tied_off + int((~same & ~clear).sum()),
        )
    print(f"vLLM vs trainer routing: {equal}/{total} (token, layer) pairs equal; {tied_off} near-tied differ")
    assert equal / total >= 0.99
    prompt_rows = len(prompts[0])
    assert (cached.routed_experts[:prompt_rows] >= 0).all()
    assert torch.equal(cached.routed_experts[:prompt_rows], completions[0].routed_experts[:prompt_rows])
