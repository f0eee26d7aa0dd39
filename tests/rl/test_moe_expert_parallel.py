"""GRPO with the actor's experts split over two workers (``actor.engine.ep_size=2``) against the
same two workers holding every expert: the expert-parallel ranks are the data-parallel ranks, so
the trainer dispatches their rows unchanged; and with the two workers also splitting each row
(``sp_size=2``)."""

import pytest

from tandem.models import TinyModelConfig, save_tiny_model
from tandem.rl import RLTrainer
from tests.rl.conftest import assert_same_histories, small_config


@pytest.fixture(scope="module")
def moe_files(rl_files, tmp_path_factory):
    """``rl_files`` with a tiny Qwen2-MoE policy (4 experts, top-2, a shared expert) as the model."""
    model = save_tiny_model(tmp_path_factory.mktemp("moe") / "model", TinyModelConfig(family="qwen2_moe"))
    return {**rl_files, "model": str(model)}


def _history(files: dict, directory, *overrides: str) -> list[dict]:
    """Two steps with routing replay and a KL loss (the frozen reference split like the actor)."""
    config = small_config(files, directory, "data.val_path=", *overrides, "actor.router_replay=rollout",
                          "algorithm.kl.use_kl_loss=true")  # fmt: skip
    return RLTrainer(config).fit().history


def test_expert_parallel_actor_matches_replicated_experts_step_for_step(moe_files, tmp_path):
    """The second step generates with weights synced from the split actor (each expert tensor
    gathered whole), so its samples, scores and losses match only if the sync delivered every
    expert."""
    one = _history(moe_files, tmp_path / "ep1", "trainer.n_workers=2", "actor.engine.ep_size=1")
    two = _history(moe_files, tmp_path / "ep2", "trainer.n_workers=2", "actor.engine.ep_size=2")
    assert len(one) == 2
    assert_same_histories(one, two)
    assert one[1]["actor/kl_loss"] > 0  # the second step's policy has moved from the reference


@pytest.mark.slow  # two more GRPO runs (~45 s)
def test_expert_and_sequence_parallel_actor_matches_one_worker(moe_files, tmp_path):
    """Two workers holding every row, split over them along the sequence (``sp_size=2``) and
    exchanging their shards' tokens in each MoE layer (``ep_size=2``), against one worker with
    every expert: the same micro-batches, so the per-micro-batch MoE metrics (load, routing
    disagreement), computed over a whole split row, agree too."""
    one = _history(moe_files, tmp_path / "one", "trainer.n_workers=1")
    split = _history(moe_files, tmp_path / "split", "trainer.n_workers=2", "actor.engine.ep_size=2",
                     "actor.engine.sp_size=2", "actor.engine.strategy=ddp")  # fmt: skip
    # a split row sums its tokens in another order: GRPO's loss, about 0, moves by ~1e-8
    assert_same_histories(one, split, absolute=1e-7)


@pytest.mark.slow  # two three-step runs with a replica process each (~60 s)
def test_expert_parallel_actor_syncs_a_rollout_replica_of_its_own(moe_files, tmp_path):
    """One-step-off: the rollout replica is another process, fed through the checkpoint engine;
    the split actor's ranks gather every expert tensor whole as its rank 0 sends the buckets, so
    the replica samples as it does from the replicated actor."""
    mode = ("pipeline.mode=one_step_off", "trainer.total_steps=3")
    one = _history(moe_files, tmp_path / "ep1", "trainer.n_workers=2", "actor.engine.ep_size=1", *mode)
    two = _history(moe_files, tmp_path / "ep2", "trainer.n_workers=2", "actor.engine.ep_size=2", *mode)
    assert len(one) == 3
    assert_same_histories(one, two)
