"""vLLM as the rollout replicas of the asynchronous pipelines (slow tier: needs vLLM, e.g. its
CPU build): weights synced into a vLLM replica give the greedy output of a fresh vLLM engine
loaded with them, and both asynchronous pipelines train with vLLM generating.

Run in an environment holding vLLM: ``python -m pytest -m slow tests/pipeline/test_vllm_replicas.py``.
"""

import math

import pytest

from tandem.checkpoint_engine import CheckpointEngineConfig
from tandem.checkpoint_engine.roles import connect_weight_sync, sync_weights
from tandem.controller import ResourcePool, create_worker_group
from tandem.engine import EngineConfig
from tandem.models import load_model
from tandem.models.loading import load_tokenizer
from tandem.models.weights import load_named_tensors
from tandem.pipeline.replica_worker import RolloutReplicaWorker
from tandem.rl import RLTrainer
from tandem.rollout import RolloutRequest, SamplingParams
from tandem.rollout.config import RolloutEngineConfig
from tests.engine.conftest import random_batch
from tests.engine.workers import EngineWorker
from tests.rl.conftest import small_config

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from tandem.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine  # noqa: E402

PROMPTS = [[5, 9, 17, 33], [40, 41, 42], [7] * 6, [60, 61, 62, 63, 64]]
VLLM = VLLMEngineConfig(max_model_len=128, max_num_seqs=16, weight_bucket_mb=1)


def _fresh_vllm_greedy(model_dir, weights, tmp_path) -> list[list[int]]:
    model = load_model(model_dir)
    load_named_tensors(model, weights.items())
    model.save_pretrained(tmp_path / "fresh")
    load_tokenizer(model_dir).save_pretrained(tmp_path / "fresh")
    engine = VLLMRolloutEngine(str(tmp_path / "fresh"), VLLM)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12)
        requests = [RolloutRequest(f"r{i}", tuple(p), params) for i, p in enumerate(PROMPTS)]
        return [list(c.token_ids) for c in engine.generate_batch(requests, timeout=300)]
    finally:
        engine.close()


def test_a_vllm_replica_answers_like_a_fresh_vllm_after_each_sync(rl_files, tmp_path):
    model_dir = rl_files["model"]
    sync = CheckpointEngineConfig(backend="shared_memory", bucket_mb=1)
    config = EngineConfig(model_path=model_dir, lr=5e-2, micro_batch_size=4)
    engine = RolloutEngineConfig(name="vllm", vllm=VLLM)
    with (
        create_worker_group(EngineWorker, ResourcePool((1,)), "process", kwargs={"config": config}) as trainer,
        create_worker_group(
            RolloutReplicaWorker, ResourcePool((1,)), "process",
            kwargs={"engine": engine, "model_path": model_dir, "device": "cpu"},
        ) as replicas,
    ):  # fmt: skip
        connect_weight_sync(trainer, replicas, sync)
        before = replicas.generate_greedy(PROMPTS, 12)[0]
        for version in (1, 2):
            trainer.train_step(random_batch(version, batch=4))
            sync_weights(trainer, replicas, version)
            assert replicas.weight_version() == [version]
        greedy = replicas.generate_greedy(PROMPTS, 12)[0]
        weights = trainer.parameters()[0]
        trainer.close_weight_sender()
        replicas.close_engine()
    assert greedy == _fresh_vllm_greedy(model_dir, weights, tmp_path)
    assert greedy != before  # the weights moved enough to change what the model says


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_the_asynchronous_pipelines_train_with_vllm_replicas(rl_files, tmp_path, mode):
    history = RLTrainer(
        small_config(
            rl_files, tmp_path, "rollout.engine.name=vllm", "rollout.engine.vllm.weight_bucket_mb=1",
            f"pipeline.mode={mode}", "trainer.total_steps=3", "data.val_path=",
            "pipeline.trainer_threads=1", "pipeline.rollout_threads=1",
        )
    ).fit().history  # fmt: skip
    assert [h["step"] for h in history] == [1, 2, 3]
    assert any(h.get("pipeline/weight_sync_gbps", 0) > 0 for h in history)  # weights reached vLLM
    for metrics in history:
        assert metrics["pipeline/staleness/max"] <= 1
        for name in ("rollout_corr/kl", "rollout_corr/max_abs_log_prob_diff", "actor/pg_loss"):
            assert math.isfinite(metrics[name]), name
        if metrics["pipeline/staleness/max"] == 0:  # vLLM's kernels against the trainer's, same weights
            assert metrics["rollout_corr/max_abs_log_prob_diff"] < 0.05
