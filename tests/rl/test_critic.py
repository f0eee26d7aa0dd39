"""PPO with a critic (``preset=ppo``): the critic trains beside the actor with verl's metrics,
learns values that predict returns better than a constant, waits the actor during its warm-up,
and resumes exactly with the actor."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tandem.engine.divergence import DivergenceError
from tandem.rl import RLTrainer
from tests.rl.conftest import small_config

PPO = ("preset=ppo", "critic.engine.lr=1e-3")


def _without_timings(history):
    return [{k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/"))} for h in history]


def test_ppo_trains_the_critic_and_the_actor_with_verl_s_metrics(rl_files, tmp_path):
    result = RLTrainer(small_config(rl_files, tmp_path, *PPO, "data.val_path=")).fit()
    for metrics in result.history:
        for name in (
            "critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/values/mean",
            "critic/returns/mean", "critic/vf_explained_var", "critic/grad_norm", "timing_s/values",
            "timing_s/update_critic", "actor/pg_loss", "actor/reward_kl",
        ):  # fmt: skip
            assert math.isfinite(metrics[name]), name
    assert (tmp_path / "checkpoints" / "global_step_2" / "critic").is_dir()


def test_the_actor_waits_during_the_critic_warm_up(rl_files, tmp_path):
    result = RLTrainer(
        small_config(
            rl_files, tmp_path, *PPO, "critic.warmup_steps=2", "data.val_path=", "trainer.export_hf=true"
        )
    ).fit()
    assert all("actor/pg_loss" not in h and "critic/vf_loss" in h for h in result.history)
    before = load_file(f"{rl_files['model']}/model.safetensors")
    after = load_file(str(result.hf_model_dir / "model.safetensors"))
    assert all(torch.equal(before[name], after[name]) for name in before)  # the policy never moved


PROMPT_REWARD = (  # the reward depends on the prompt only: a critic can learn it, a constant cannot
    "def compute_score(data_source, solution, ground_truth, extra_info):\n"
    "    return float(int(extra_info['expression'].split('+')[0]) >= 50)\n"
)


@pytest.mark.parametrize("mode, placement", [("one_step_off", "separate"), ("fully_async", "colocated")])
def test_ppo_in_the_asynchronous_pipelines(rl_files, tmp_path, mode, placement):
    """The critic scores and learns from batches that rollout replicas generated with older weights."""
    result = RLTrainer(
        small_config(
            rl_files, tmp_path, *PPO, f"pipeline.mode={mode}", f"critic.placement={placement}",
            "data.val_path=", "trainer.total_steps=3", "pipeline.trainer_threads=1", "pipeline.rollout_threads=1",
        )
    ).fit()  # fmt: skip
    assert [h["step"] for h in result.history] == [1, 2, 3]
    for metrics in result.history:
        for name in ("critic/vf_loss", "critic/vf_explained_var", "critic/grad_norm", "actor/pg_loss"):
            assert math.isfinite(metrics[name]), name
        assert metrics["pipeline/staleness/max"] <= 1


def test_critic_values_predict_returns_better_than_a_constant(rl_files, tmp_path):
    """The actor waits (critic warm-up); the critic learns a reward that only the prompt decides.
    Measured here: explained variance ~0.0 for 15 steps, then 0.3-0.9 from step ~21 (0.89 at 30)."""
    reward = tmp_path / "prompt_reward.py"
    reward.write_text(PROMPT_REWARD)
    steps = 30
    history = RLTrainer(
        small_config(
            rl_files, tmp_path / "run", *PPO, f"reward.custom_path={reward}", "data.val_path=",
            f"trainer.total_steps={steps}", f"critic.warmup_steps={steps}", "algorithm.lam=1.0",
            "data.train_batch_size=16", "critic.engine.lr=3e-4", "critic.ppo_epochs=4",
        )
    ).fit().history  # fmt: skip
    # explained variance on each step's fresh samples, before that step's critic update:
    # 1 - Var(returns - values) / Var(returns); the best constant scores 0
    explained = [h["critic/vf_explained_var"] for h in history]
    assert explained[0] < 0.1
    assert sorted(explained[-5:])[2] > 0.4, explained  # the median of the last five steps


def test_ppo_resume_equals_the_uninterrupted_run(rl_files, tmp_path):
    full = RLTrainer(
        small_config(rl_files, tmp_path / "full", *PPO, "trainer.total_steps=4", "data.val_path=")
    ).fit()
    RLTrainer(
        small_config(rl_files, tmp_path / "part", *PPO, "trainer.total_steps=2", "data.val_path=")
    ).fit()
    resumed = RLTrainer(
        small_config(rl_files, tmp_path / "part", *PPO, "trainer.total_steps=4", "data.val_path=")
    ).fit()
    assert [h["step"] for h in resumed.history] == [3, 4]
    assert _without_timings(resumed.history) == _without_timings(full.history[2:])
    assert json.loads((tmp_path / "part" / "status.json").read_text())["status"] == "finished"


def test_a_diverging_critic_stops_the_run_naming_the_step(rl_files, tmp_path):
    trainer = RLTrainer(small_config(rl_files, tmp_path, *PPO, "critic.engine.lr=1e30", "data.val_path="))
    with pytest.raises(
        DivergenceError, match=r"step 1: after the update the critic's (weights|values) are not finite"
    ):
        trainer.fit()
    assert not (tmp_path / "checkpoints" / "global_step_1").exists()


@pytest.mark.parametrize(
    "backend, workers", [("local", 1), ("local", 2), pytest.param("ray", 2, marks=pytest.mark.slow)]
)  # ray: the same run on another backend (slow tier)
def test_a_colocated_critic_trains_as_a_separate_one(rl_files, tmp_path, backend, workers, request):
    """The critic inside the actor's processes (or, alone, the controller's) computes what its
    own processes do. On Ray, rank 0's roles join the group through the store its process hosts."""
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    runs = [
        RLTrainer(
            small_config(
                rl_files, tmp_path / placement, *PPO, f"trainer.n_workers={workers}", f"critic.placement={placement}",
                "data.val_path=", f"trainer.backend={backend}",
            )
        ).fit().history
        for placement in ("separate", "colocated")
    ]  # fmt: skip
    for separate, colocated in zip(*runs, strict=True):
        for name in ("critic/vf_loss", "critic/values/mean", "critic/vf_explained_var", "actor/pg_loss"):
            assert colocated[name] == pytest.approx(separate[name], rel=1e-5, abs=1e-7), name


SEQUENCE_PARALLEL = ("actor.engine.sp_size=2", "critic.engine.sp_size=2")
TENSOR_PARALLEL = ("actor.engine.tp_size=2", "critic.engine.tp_size=2")


@pytest.mark.parametrize(
    "two_workers",
    [
        (),
        SEQUENCE_PARALLEL,
        # the colocated placement with two workers: tested in the default tier by
        # test_a_colocated_critic_trains_as_a_separate_one, its sequence-parallel form here (slow)
        pytest.param((*SEQUENCE_PARALLEL, "critic.placement=colocated"), marks=pytest.mark.slow),
        pytest.param((*TENSOR_PARALLEL, "critic.placement=colocated"), marks=pytest.mark.slow),  # ~50 s
    ],
    ids=["data-parallel", "sequence-parallel", "sequence-parallel-colocated", "tensor-parallel-colocated"],
)
def test_two_workers_train_the_critic_like_one(rl_files, tmp_path, two_workers):
    """The critic's group splits each step over its workers and divides by global counts: the
    same losses, values and returns as one worker (DDP over two processes; or both workers on
    every row, each packed row split between them: sequence parallelism, the critic in its
    own processes or in the actor's; or each layer's weights split between them, the value
    head replicated: tensor parallelism)."""
    runs = [
        RLTrainer(
            small_config(rl_files, tmp_path / str(n), *PPO, f"trainer.n_workers={n}", "data.val_path=", *extra)
        ).fit().history
        for n, extra in ((1, ()), (2, two_workers))
    ]  # fmt: skip
    names = (
        "critic/vf_loss",
        "critic/values/mean",
        "critic/returns/mean",
        "critic/vf_explained_var",
        "actor/pg_loss",
    )
    for one, two in zip(*runs, strict=True):
        for name in names:
            assert two[name] == pytest.approx(one[name], rel=1e-4, abs=1e-6), name
