"""The colocated worker's native rollout engine holds the actor's own weight tensors (one copy, not
two), and a run doing so equals the old path, where the engine held a copy and kept its packs."""

import pytest

from tandem.controller import create_worker_group
from tandem.rl import RLTrainer
from tandem.rl.worker import ActorRolloutRefWorker
from tests.rl.conftest import assert_same_histories, small_config


def test_the_rollout_engine_holds_the_actors_tensors(rl_files, tmp_path):
    config = small_config(rl_files, tmp_path)
    with create_worker_group(ActorRolloutRefWorker, config.resource_pool(), "local", args=(config,)) as group:
        group.init_model(1)
        worker = group.backend.worker
        actor = {name: p.data_ptr() for name, p in worker.engine.causal_lm.named_parameters()}
        rollout = {name: p.data_ptr() for name, p in worker.rollout.model.named_parameters()}
        assert rollout == actor
        reference = {p.data_ptr() for p in worker.reference.causal_lm.parameters()}
        assert not reference & set(actor.values())  # the frozen reference keeps its own copy
        group.shutdown_engines()


@pytest.mark.slow  # two runs; the fast siblings: above, and tests/rollout/test_shared_weights.py
def test_a_run_sharing_the_weights_equals_one_copying_them(rl_files, tmp_path, monkeypatch):
    """Two steps (the second generates with the first's update): metrics equal the old path's."""
    shared = RLTrainer(small_config(rl_files, tmp_path / "shared")).fit().history
    monkeypatch.setattr(ActorRolloutRefWorker, "_share_rollout_weights", lambda self: None)
    monkeypatch.setattr("tandem.rollout.native.NativeRolloutEngine.release_packed_weights", lambda self: None)
    copied = RLTrainer(small_config(rl_files, tmp_path / "copied")).fit().history
    assert_same_histories(copied, shared)
