"""Weights from a trainer group to rollout replicas in other processes, for every backend:
replica weights equal the trainer's bit for bit, and greedy output equals an engine freshly
loaded with those weights."""

import dataclasses
from pathlib import Path

import pytest
import torch

from tandem.checkpoint_engine import CheckpointEngineConfig
from tandem.checkpoint_engine.roles import connect_weight_sync, sync_weights
from tandem.controller import ResourcePool, create_worker_group
from tandem.engine import EngineConfig
from tandem.models import load_model
from tandem.models.loading import load_tokenizer
from tandem.models.weights import load_named_tensors
from tandem.pipeline.replica_worker import RolloutReplicaWorker
from tandem.rollout import RolloutRequest, SamplingParams
from tandem.rollout.config import RolloutEngineConfig
from tandem.rollout.native import NativeEngineConfig, NativeRolloutEngine
from tests.engine.conftest import random_batch
from tests.engine.workers import EngineWorker

PROMPTS = [[5, 9, 17, 33], [40, 41, 42], [7] * 6]
ENGINE = RolloutEngineConfig(native=NativeEngineConfig(max_model_len=64, max_num_seqs=8, device="cpu"))


def _fresh_engine_greedy(model_dir, weights, tmp_path):
    """Greedy output of a native engine built from an HF directory holding ``weights``."""
    model = load_model(model_dir)
    load_named_tensors(model, weights.items())
    model.save_pretrained(tmp_path / "fresh")
    load_tokenizer(model_dir).save_pretrained(tmp_path / "fresh")
    engine = NativeRolloutEngine.from_pretrained(str(tmp_path / "fresh"), ENGINE.native)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    out = engine.generate_batch([RolloutRequest(f"r{i}", tuple(p), params) for i, p in enumerate(PROMPTS)])
    engine.close()
    return [list(c.token_ids) for c in out]


def _bucket_files(sync: CheckpointEngineConfig) -> set:
    directory = Path(sync.directory or "/dev/shm")
    return set(directory.glob("tandem-weights*")) if directory.exists() else set()


@pytest.mark.parametrize(
    ("backend", "trainer_ranks", "strategy"),
    [
        pytest.param("broadcast", 1, "single", marks=pytest.mark.slow),  # broadcast: (2, fsdp2) below
        ("shared_memory", 1, "single"),
        ("files", 1, "single"),
        ("broadcast", 2, "fsdp2"),
    ],
)
def test_replicas_hold_the_trainers_weights_after_each_sync(
    tiny_model_dir, tmp_path, backend, trainer_ranks, strategy
):
    sync = CheckpointEngineConfig(
        backend=backend,
        bucket_mb=0.02,
        directory=str(tmp_path / "buckets") if backend == "files" else "",
        timeout_s=60,
    )
    config = EngineConfig(model_path=tiny_model_dir, strategy=strategy, lr=5e-2, micro_batch_size=4)
    files_before = _bucket_files(sync)
    trainer_pool, replica_pool = ResourcePool((trainer_ranks,)), ResourcePool((2,))
    with (
        create_worker_group(EngineWorker, trainer_pool, "process", kwargs={"config": config}) as trainer,
        create_worker_group(
            RolloutReplicaWorker,
            replica_pool,
            "process",
            kwargs={"engine": ENGINE, "model_path": tiny_model_dir, "device": "cpu"},
        ) as replicas,
    ):
        connect_weight_sync(trainer, replicas, sync)
        before = replicas.generate_greedy(PROMPTS, 8)[0]
        for version in (1, 2):
            trainer.train_step(random_batch(version, batch=4 * trainer_ranks))
            stats = sync_weights(trainer, replicas, version)
            expected = trainer.parameters()[0]
            assert stats.buckets > 3 and stats.bytes >= sum(
                t.numel() * t.element_size() for t in expected.values()
            )
            for weights in replicas.model_weights():
                assert weights.keys() >= expected.keys()
                assert all(torch.equal(weights[name], tensor) for name, tensor in expected.items())
            assert replicas.weight_version() == [version, version]
        greedy = replicas.generate_greedy(PROMPTS, 8)
        assert greedy[0] == greedy[1] == _fresh_engine_greedy(tiny_model_dir, expected, tmp_path)
        assert greedy[0] != before  # the weights moved enough to change what the model says
        trainer.close_weight_sender()
        replicas.close_engine()
    assert _bucket_files(sync) == files_before  # the sender removed its buckets and slot files


def test_replicas_receive_the_unsharded_weights_of_a_tensor_parallel_trainer(tiny_model_dir):
    """A trainer of two tensor-parallel ranks (FSDP2 over ``(dp, tp) = (1, 2)``) sends each
    parameter gathered whole (``full_tensor()``, one at a time, packed into small buckets as they
    come). Before any step the replicas hold the checkpoint's weights bit for bit (the shards
    put back together are the tensors they were cut from); after a step, the weights of one
    process training the whole model on the same rows, within 1e-5 (the split sums round
    differently), and exactly what the trainer's own ranks gather."""
    sync = CheckpointEngineConfig(backend="broadcast", bucket_mb=0.02, timeout_s=60)
    # Adam's eps well above the gradients' rounding: its first step is lr * sign(g) where g is
    # tiny, which would turn the split sums' rounding into whole steps
    config = EngineConfig(model_path=tiny_model_dir, lr=1e-2, eps=1e-3, micro_batch_size=4)
    split = dataclasses.replace(config, strategy="fsdp2", tp_size=2)
    batch = random_batch(1, batch=4)
    with (
        create_worker_group(EngineWorker, ResourcePool((1,)), "local", kwargs={"config": config}) as whole,
        create_worker_group(EngineWorker, ResourcePool((2,)), "process", kwargs={"config": split}) as trainer,
        create_worker_group(
            RolloutReplicaWorker,
            ResourcePool((1,)),
            "process",
            kwargs={"engine": ENGINE, "model_path": tiny_model_dir, "device": "cpu"},
        ) as replicas,
    ):
        connect_weight_sync(trainer, replicas, sync)
        checkpoint = load_model(tiny_model_dir).state_dict()
        stats = sync_weights(trainer, replicas, 1)
        largest = max(t.numel() * t.element_size() for t in checkpoint.values())
        assert stats.buckets > 3 and stats.bytes / stats.buckets <= max(sync.bucket_bytes, largest)
        for weights in replicas.model_weights():
            assert weights.keys() == checkpoint.keys()
            assert all(torch.equal(weights[name], tensor) for name, tensor in checkpoint.items())
        whole.train_step_on_shard([batch])
        trainer.train_step_on_shard([batch, batch])  # both ranks of the group take the same rows
        sync_weights(trainer, replicas, 2)
        expected, gathered = whole.parameters()[0], trainer.parameters()
        for weights in replicas.model_weights():
            for name, tensor in expected.items():
                assert all(torch.equal(weights[name], rank[name]) for rank in gathered), name
                torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5, msg=name)
            assert any(not torch.equal(weights[name], checkpoint[name]) for name in expected)
        assert replicas.weight_version() == [2]
        trainer.close_weight_sender()
        replicas.close_engine()
