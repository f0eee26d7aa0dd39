"""vLLM as the RL loop's rollout engine (slow tier: needs vLLM, e.g. its CPU build).

Run in an environment holding vLLM: ``python -m pytest -m slow tests/rl/test_vllm_loop.py``.
"""

import math

import pytest

from tandem.controller import WorkerError
from tandem.models.weights import read_hf_weights
from tandem.rl import RLTrainer
from tandem.rollout import RolloutRequest, SamplingParams
from tests.rl.conftest import small_config
from tests.rollout.test_native_engine import random_prompts

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from vllm.triton_utils import HAS_TRITON  # noqa: E402

from tandem.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine  # noqa: E402


def _greedy(engine, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = [RolloutRequest(f"g{i}", p, params) for i, p in enumerate(prompts)]
    return [c.token_ids for c in engine.generate_batch(requests, timeout=300)]


def test_grpo_steps_with_vllm_generating_log_the_mismatch(rl_files, tmp_path):
    overrides = ("rollout.engine.name=vllm", "rollout.engine.vllm.weight_bucket_mb=1", "data.val_path=")
    history = RLTrainer(small_config(rl_files, tmp_path, *overrides)).fit().history
    assert [h["step"] for h in history] == [1, 2]
    for metrics in history:
        for name in ("rollout_corr/kl", "rollout_corr/max_abs_log_prob_diff", "rollout_corr/ratio_mean"):
            assert math.isfinite(metrics[name]), name
        assert metrics["rollout_corr/max_abs_log_prob_diff"] < 0.05  # vLLM's kernels, not the trainer's
        assert math.isfinite(metrics["actor/pg_loss"]) and metrics["response_length/mean"] > 0


def test_bucketed_weight_update_equals_a_fresh_engine_with_those_weights(rl_files, tmp_path):
    from tandem.models import TinyModelConfig, save_tiny_model

    other = str(save_tiny_model(tmp_path / "other", TinyModelConfig(family="qwen2", seed=9)))
    prompts = random_prompts(8, 3)
    config = VLLMEngineConfig(max_model_len=128, max_num_seqs=16, weight_bucket_mb=1)
    engine = VLLMRolloutEngine(rl_files["model"], config)
    try:
        before = _greedy(engine, prompts)
        engine.update_weights(read_hf_weights(other), version=1)  # several 1 MiB buckets
        updated = _greedy(engine, prompts)
    finally:
        engine.close()
    fresh = VLLMRolloutEngine(other, config)
    try:
        expected = _greedy(fresh, prompts)
    finally:
        fresh.close()
    assert updated == expected != before


def _moe_files(rl_files, tmp_path):
    from tandem.models import TinyModelConfig, save_tiny_model

    return {
        **rl_files,
        "model": str(save_tiny_model(tmp_path / "moe", TinyModelConfig(family="qwen3_moe", seed=3))),
    }


@pytest.mark.skipif(HAS_TRITON, reason="this vLLM has Triton, so it can record routing")
def test_replay_with_vllm_that_cannot_record_fails_naming_the_key(rl_files, tmp_path):
    overrides = ("rollout.engine.name=vllm", "actor.router_replay=rollout", "data.val_path=")
    with pytest.raises(WorkerError, match=r"vllm.record_routing=True: this vLLM cannot record the experts"):
        RLTrainer(small_config(_moe_files(rl_files, tmp_path), tmp_path / "run", *overrides)).fit()


@pytest.mark.gpu
def test_grpo_with_vllm_recording_the_routing_replays_it(rl_files, tmp_path):
    """A tiny Qwen3-MoE policy, vLLM recording each token's experts (vLLM records only on a GPU):
    two replayed GRPO steps, the trainer's live routing close to vLLM's (both fp32)."""
    overrides = ("rollout.engine.name=vllm", "actor.router_replay=rollout", "data.val_path=")
    history = (
        RLTrainer(small_config(_moe_files(rl_files, tmp_path), tmp_path / "run", *overrides)).fit().history
    )
    assert [h["step"] for h in history] == [1, 2]
    for metrics in history:
        assert metrics["moe/routing_disagreement"] <= 0.01  # measured before replay: vLLM's vs the trainer's
        assert metrics["rollout_corr/max_abs_log_prob_diff"] < 0.05
        assert math.isfinite(metrics["actor/pg_loss"])
