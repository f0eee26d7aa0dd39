"""GRPO on a tiny mixture-of-experts policy with rollout routing replay, sync and fully async:
in fp32 replay reproduces the run without it bit for bit, the recorded routing crosses the async
sample store aligned with its tokens, a resumed run equals the uninterrupted one, and the
held-out score (the share of digits, which a random tiny model learns in a few steps) rises."""

import math

import pytest

from tandem.models import TinyModelConfig, save_tiny_model
from tandem.rl import RLTrainer
from tandem.rl.derived import rollout_engine_config
from tests.rl.conftest import small_config
from tests.rl.test_trainer import CORE_METRICS, _without_timings

MOE_METRICS = ["moe/load_max_share", "moe/load_entropy", "moe/routing_disagreement"]
TRAINED = [name for name in CORE_METRICS if name != "timing_s/ref"] + MOE_METRICS  # the reference is optional
VAL_SCORE = "val-aux/arithmetic/score/mean@1"
STEPS = 4


@pytest.fixture(scope="module")
def moe_files(rl_files, tmp_path_factory):
    """``rl_files`` with a tiny Qwen2-MoE policy (4 experts, top-2, a shared expert) as the model."""
    model = save_tiny_model(tmp_path_factory.mktemp("moe") / "model", TinyModelConfig(family="qwen2_moe"))
    return {**rl_files, "model": str(model)}


def _train(files, output_dir, *overrides):
    config = small_config(
        files, output_dir, f"trainer.total_steps={STEPS}", f"trainer.val_every={STEPS}", *overrides
    )
    result = RLTrainer(config).fit()
    return result, [h for h in result.history if h["step"] > 0]


def _check_trains(result, steps):
    """Finite metrics every step, the routing metrics present, the held-out score up."""
    assert [h["step"] for h in steps] == list(range(1, STEPS + 1))
    for metrics in steps:
        for name in TRAINED:
            assert math.isfinite(metrics[name]), name
        assert 0.25 <= metrics["moe/load_max_share"] <= 0.5  # 1/E balanced .. 1/k in every top-k
    first, last = result.history[0], result.history[-1]
    assert first["step"] == 0 and last["step"] == STEPS
    assert last[VAL_SCORE] > first[VAL_SCORE] + 0.3, (first[VAL_SCORE], last[VAL_SCORE])


def test_sync_grpo_with_replay_equals_the_run_without_it_in_fp32(moe_files, tmp_path):
    """fp32 rollout and trainer route alike, so replaying the rollout's experts changes no bit.
    Without the KL loss: the reference would replay the policy's routing, not its own choice."""
    no_reference = "algorithm.kl.use_kl_loss=false"
    replayed, replayed_steps = _train(
        moe_files, tmp_path / "replay", "actor.router_replay=rollout", no_reference
    )
    _check_trains(replayed, replayed_steps)
    for metrics in replayed_steps:
        assert metrics["rollout_corr/max_abs_log_prob_diff"] < 1e-4  # as for dense models
        assert metrics["moe/routing_disagreement"] == 0.0
    live, _ = _train(moe_files, tmp_path / "live", "actor.router_replay=off", no_reference)
    assert _without_timings(replayed.history) == _without_timings(live.history)


def test_fully_async_grpo_replays_routing_from_the_sample_store(moe_files, tmp_path):
    """Step 1 trains samples of the weights it holds (staleness 0): the routing that crossed the
    sample store equals the trainer's live choice token for token, and log-probs agree as for dense
    models. Later steps train samples one version old, whose routing differs from the live one."""
    result, steps = _train(
        moe_files, tmp_path, "actor.router_replay=rollout", "pipeline.mode=fully_async",
        "pipeline.staleness_threshold=1", "pipeline.trainer_threads=1", "pipeline.rollout_threads=1",
    )  # fmt: skip
    _check_trains(result, steps)
    assert steps[0]["rollout_corr/max_abs_log_prob_diff"] < 1e-4
    assert steps[0]["moe/routing_disagreement"] == 0.0
    assert max(h["moe/routing_disagreement"] for h in steps[1:]) > 0.0  # stale routing, replayed


def test_a_resumed_replay_run_equals_the_uninterrupted_one(moe_files, tmp_path):
    overrides = ("actor.router_replay=rollout", "data.val_path=")
    full = RLTrainer(small_config(moe_files, tmp_path / "full", "trainer.total_steps=3", *overrides)).fit()
    first = RLTrainer(small_config(moe_files, tmp_path / "part", "trainer.total_steps=1", *overrides)).fit()
    assert _without_timings(first.history) == _without_timings(full.history[:1])
    assert (tmp_path / "part" / "checkpoints" / "latest").read_text() == "global_step_1"
    resumed = RLTrainer(small_config(moe_files, tmp_path / "part", "trainer.total_steps=3", *overrides)).fit()
    assert [h["step"] for h in resumed.history] == [2, 3]
    assert _without_timings(resumed.history) == _without_timings(full.history[1:])
    assert all("moe/routing_disagreement" in h for h in resumed.history)


def test_replay_without_recorded_experts_is_refused_naming_the_keys(moe_files, tmp_path):
    with pytest.raises(ValueError, match="agent episodes"):
        small_config(moe_files, tmp_path, "actor.router_replay=rollout", "agent.name=tool_agent")


@pytest.mark.parametrize(
    ("replay", "asked", "records"), [("rollout", False, True), ("off", False, False), ("off", True, True)]
)
def test_replay_with_vllm_turns_its_recording_on(moe_files, tmp_path, replay, asked, records):
    """vLLM records the experts when replay needs them, or when asked (the routing metrics);
    the GRPO run itself needs vLLM on a GPU (tests/rl/test_vllm_loop.py, gpu tier)."""
    config = small_config(
        moe_files, tmp_path, "rollout.engine.name=vllm", f"actor.router_replay={replay}",
        f"rollout.engine.vllm.record_routing={str(asked).lower()}",
    )  # fmt: skip
    vllm = rollout_engine_config(config, "cpu").vllm
    assert (vllm.record_routing, vllm.prefix_caching) == (records, records)
