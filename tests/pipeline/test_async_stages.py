"""The trainer's stages over any batch source: DAPO's dynamic sampling, ReMax's greedy baselines and
online DPO run with rollout replicas (one-step-off and fully async) as they do in the sync
pipeline, and every trained token stays within the mode's staleness bound."""

import pytest

from tandem.rl import RLTrainer
from tests.rl.conftest import small_config

TWO_CORES = ("pipeline.trainer_threads=1", "pipeline.rollout_threads=1")
MODES = {  # mode -> (its overrides, the most versions a trained token may lag)
    "one_step_off": (("pipeline.mode=one_step_off",), 1),
    "fully_async": (("pipeline.mode=fully_async", "pipeline.staleness_threshold=1"), 1),
}
STEPS = 3


class CollectingTrainer(RLTrainer):
    """Keeps every step's collected batch (after its stages, before the update)."""

    def collect_batch(self, timings):
        batch, metrics = super().collect_batch(timings)
        self.collected = getattr(self, "collected", [])
        self.collected.append((self.step, batch))
        return batch, metrics


def _run(rl_files, tmp_path, mode, *overrides):
    mode_overrides, bound = MODES[mode]
    batch_path = "dataplane.enabled=false"  # the checks below read each token's weight_version here
    config = small_config(
        rl_files, tmp_path, *mode_overrides, *TWO_CORES, f"trainer.total_steps={STEPS}", batch_path, *overrides
    )  # fmt: skip
    trainer = CollectingTrainer(config)
    result = trainer.fit()
    steps = [h for h in result.history if h["step"] > 0]
    assert [h["step"] for h in steps] == list(range(1, STEPS + 1))
    for step, batch in trainer.collected:
        assert len(batch) == config.data.train_batch_size * config.rollout.n
        mask = batch["response_mask"].bool()
        lag = (step - 1) - batch["weight_version"][mask]
        assert int(lag.min()) >= 0 and int(lag.max()) <= bound, (step, mode)
    return trainer, steps


@pytest.fixture
def constant_reward(tmp_path):
    """A reward that scores every response alike: no group carries a signal, so dynamic sampling
    draws as often as it may in every step."""
    path = tmp_path / "constant_reward.py"
    path.write_text("def compute_score(data_source, solution, ground_truth, extra_info):\n    return 0.5\n")
    return path


@pytest.mark.parametrize("mode", sorted(MODES))
def test_dynamic_sampling_draws_again_within_the_staleness_bound(rl_files, tmp_path, constant_reward, mode):
    trainer, steps = _run(
        rl_files, tmp_path / "run", mode, "preset=dapo", f"reward.custom_path={constant_reward}",
        "algorithm.filter_groups.max_num_gen_batches=2", "reward.overlong.enable=false",
    )  # fmt: skip
    for metrics in steps:
        assert metrics["dynamic_sampling/gen_rounds"] == 2.0  # no group informative: every draw spent
        assert metrics["dynamic_sampling/informative_groups"] == 0.0
    # each step trained on the first draw's groups topped up from the second: 8 distinct groups seen
    for _, batch in trainer.collected:
        assert len(set(batch["uid"])) == trainer.config.data.train_batch_size


@pytest.mark.parametrize("mode", sorted(MODES))
def test_remax_gets_a_greedy_baseline_per_group(rl_files, tmp_path, mode):
    trainer, steps = _run(rl_files, tmp_path / "run", mode, "preset=remax")
    n = trainer.config.rollout.n
    for _, batch in trainer.collected:
        baselines = batch["reward_baselines"].view(-1, n)
        assert (baselines == baselines[:, :1]).all()  # one greedy response per prompt group
        assert ((baselines >= 0) & (baselines <= 1)).all()  # scored by the run's reward
    for metrics in steps:
        assert metrics["timing_s/gen_greedy"] > 0


@pytest.mark.parametrize("mode", sorted(MODES))
def test_online_dpo_trains_each_groups_best_against_its_worst(rl_files, tmp_path, mode):
    _, steps = _run(rl_files, tmp_path / "run", mode, "preset=online_dpo")
    for metrics in steps:
        assert metrics["online_dpo/groups_with_preference"] > 0
        assert metrics["online_dpo/chosen_score"] > metrics["online_dpo/rejected_score"]
        assert "actor/preference_loss" in metrics and "pipeline/staleness/max" in metrics


def test_distillation_scores_replica_samples_on_the_trainer(rl_files, tmp_path):
    """The policy's own starting weights as the teacher: at step 1 the student is the teacher, so
    its reverse KL, top-k divergence and greedy disagreement are 0; later steps move it away."""
    _, steps = _run(
        rl_files, tmp_path, "fully_async", f"teacher.model_path={rl_files['model']}",
        "algorithm.distill.objective=jsd", "teacher.top_k=4",
    )  # fmt: skip
    first = steps[0]
    assert abs(first["distill/reverse_kl"]) < 1e-6
    assert first["distill/teacher_log_prob"] == pytest.approx(first["distill/student_log_prob"], abs=1e-6)
    assert abs(first["distill/loss"]) < 1e-6 and first["distill/greedy_agreement"] == 1.0
    assert steps[-1]["distill/reverse_kl"] != 0.0
