"""GRPO with the actor's experts split over two workers (``actor.engine.ep_size=2``) against the
same two workers holding every expert: the expert-parallel ranks are the data-parallel ranks, so
the trainer dispatches their rows unchanged."""

import pytest

from tandem.models import TinyModelConfig, save_tiny_model
from tandem.rl import RLTrainer
from tests.rl.conftest import assert_same_histories, small_config


@pytest.fixture(scope="module")
def moe_files(rl_files, tmp_path_factory):
    """``rl_files`` with a tiny Qwen2-MoE policy (4 experts, top-2, a shared expert) as the model."""
    model = save_tiny_model(tmp_path_factory.mktemp("moe") / "model", TinyModelConfig(family="qwen2_moe"))
    return {**rl_files, "model": str(model)}


def test_expert_parallel_actor_matches_replicated_experts_step_for_step(moe_files, tmp_path):
    """Two steps with routing replay and a KL loss (the frozen reference split too): the second
    step generates with weights synced from the split actor (each expert tensor gathered whole),
    so its samples, scores and losses match only if the sync delivered every expert."""
    runs = [
        RLTrainer(
            small_config(moe_files, tmp_path / f"ep{ep}", "data.val_path=", "trainer.n_workers=2",
                         f"actor.engine.ep_size={ep}", "actor.router_replay=rollout",
                         "algorithm.kl.use_kl_loss=true")
        ).fit().history
        for ep in (1, 2)
    ]  # fmt: skip
    one, two = runs
    assert len(one) == 2
    assert_same_histories(one, two)
    assert one[1]["actor/kl_loss"] > 0  # the second step's policy has moved from the reference
