"""Non-finite steps are skipped on every rank alike and leave the weights alone; the health check
tells finite-but-wrecked weights from sound ones."""

import math
from pathlib import Path

import pytest
import torch

from tandem.controller import ResourcePool, create_worker_group
from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.engine.divergence import DivergenceError, ModelHealth, SkippedUpdates, check_health
from tandem.sft.loss import sft_loss
from tests.engine.conftest import random_batch
from tests.engine.workers import EngineWorker


def _engine(tiny_model_dir) -> TorchTrainEngine:
    engine = TorchTrainEngine(EngineConfig(model_path=tiny_model_dir, lr=1e-2, micro_batch_size=4))
    engine.initialize()
    return engine


def _snapshot(engine):
    return [p.detach().clone() for p in engine.causal_lm.parameters()], {
        k: {n: v.clone() for n, v in s.items() if isinstance(v, torch.Tensor)}
        for k, s in engine.optimizer.state.items()
    }


def _loss(engine, batch, scale: float) -> float:
    normalizer = engine.global_normalizer(batch["loss_mask"])

    def scaled(outputs, mb, **kwargs):
        loss, metrics = sft_loss(outputs, mb, normalizer=normalizer, **kwargs)
        return loss * scale, metrics

    return engine.forward_backward(batch, scaled).loss


def test_a_nan_loss_skips_the_step_and_leaves_weights_and_optimizer_state_alone(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    batch = random_batch(0)
    _loss(engine, batch, 1.0)
    engine.optimizer_step()  # the optimizer has state to protect
    params, state = _snapshot(engine)

    loss = _loss(engine, batch, math.nan)
    norm = engine.optimizer_step(skip=not math.isfinite(loss))
    assert not math.isfinite(loss) and not math.isfinite(norm) and engine.last_step_skipped
    after, after_state = _snapshot(engine)
    assert all(torch.equal(a, b) for a, b in zip(params, after, strict=True))
    assert all(torch.equal(state[k][n], after_state[k][n]) for k in state for n in state[k])
    assert all(p.grad is None for p in engine.causal_lm.parameters())  # nothing leaks into the next step

    _loss(engine, batch, 1.0)
    engine.optimizer_step()
    assert not engine.last_step_skipped
    assert any(not torch.equal(a, b) for a, b in zip(params, _snapshot(engine)[0], strict=True))


def test_asking_to_skip_with_a_finite_norm_skips_too(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    params, _ = _snapshot(engine)
    _loss(engine, random_batch(1), 1.0)
    assert math.isfinite(engine.optimizer_step(skip=True)) and engine.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(params, _snapshot(engine)[0], strict=True))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_one_rank_asking_to_skip_makes_every_rank_skip(tiny_model_dir, strategy):
    config = EngineConfig(model_path=tiny_model_dir, strategy=strategy, lr=1e-2, micro_batch_size=4)
    batch = random_batch(2)
    with create_worker_group(EngineWorker, ResourcePool((2,)), "process", kwargs={"config": config}) as group:
        only_rank0 = batch.assign(tensors={"skip": torch.arange(len(batch)) < len(batch) // 2})
        out = group.step_asking_to_skip(only_rank0)
        assert out["skipped"].all() and not out["moved"].any()
        out = group.step_asking_to_skip(
            batch.assign(tensors={"skip": torch.zeros(len(batch), dtype=torch.bool)})
        )
        assert not out["skipped"].any() and out["moved"].all()


def test_health_tells_wrecked_weights_from_sound_ones(tiny_model_dir):
    engine = TorchTrainEngine(EngineConfig(model_path=tiny_model_dir, lr=1e30, micro_batch_size=4))
    engine.initialize()
    probe = random_batch(3)[:1]
    sound = engine.health(probe)
    assert sound.ok and 0 < sound.max_abs_weight < 10
    _loss(engine, random_batch(4), 1.0)
    assert math.isfinite(engine.optimizer_step())  # a finite step with lr=1e30: weights near 1e30, all finite
    wrecked = engine.health(probe)
    assert wrecked.finite_weights and not wrecked.finite_log_probs and not wrecked.ok
    with pytest.raises(
        DivergenceError, match=r"step 7: .*log-probs are not finite .*The last checkpoint is /c"
    ):
        check_health([sound, wrecked], 7, lambda: Path("/c"))
    with torch.no_grad():
        next(engine.causal_lm.parameters()).view(-1)[0] = math.nan
    assert not engine.health().finite_weights
    with pytest.raises(DivergenceError, match="step 8: after the update the weights are not finite"):
        check_health([ModelHealth(False, math.nan)], 8, lambda: None)


def test_skipped_updates_stop_only_after_the_limit_in_a_row():
    skipped = SkippedUpdates(limit=3, field="trainer.max_skipped_updates_in_a_row")
    for step, skip in enumerate([True, True, False, True, True], start=1):
        skipped.record(skip)
        skipped.check(step)
    assert (skipped.in_a_row, skipped.total) == (2, 4)
    skipped.record(True)
    with pytest.raises(
        DivergenceError, match=r"step 6: 3 optimizer steps in a row .*max_skipped_updates_in_a_row=3"
    ):
        skipped.check(6)


def test_a_resumed_engine_takes_this_runs_learning_rate(tiny_model_dir, tmp_path):
    """Going back to a checkpoint with a lower rate (after divergence) must use it, on the same schedule."""

    def engine(lr):
        built = TorchTrainEngine(
            EngineConfig(
                model_path=tiny_model_dir, lr=lr, lr_schedule="linear", total_steps=10, micro_batch_size=4
            )
        )
        built.initialize()
        return built

    trained = engine(1e-3)
    for step in range(3):
        _loss(trained, random_batch(step), 1.0)
        trained.optimizer_step()
        trained.lr_step()
    trained.save(str(tmp_path / "ckpt"))
    same, lower = engine(1e-3), engine(2e-4)
    same.load(str(tmp_path / "ckpt"))
    lower.load(str(tmp_path / "ckpt"))
    assert same.lr == trained.lr  # unchanged rate: bit-exact resume
    assert lower.lr == pytest.approx(trained.lr * 0.2, rel=1e-12)
    for resumed, expected in ((same, trained.lr), (lower, trained.lr * 0.2)):
        resumed.lr_step()
        assert resumed.lr == pytest.approx(
            expected * 6 / 7, rel=1e-9
        )  # linear decay continues: 7 → 6 steps left
