"""GKD (``algorithm.distill.lmbda < 1``) with ``dataplane.enabled``: a step on the dataset's
responses is built on the ranks that read it (the controller sends each rank its rows' requests,
as a generation does; the rank tokenises the responses and keeps the padded rows in its store),
and its rollout log-probs are its old ones copied where they live: no view stage reads a
per-token field on the controller. Seed 0, lmbda 0.5: step 1 trains on the rows' own responses,
step 2 on sampled ones. Metrics equal the ``Batch`` path's step for step (bit for bit, but the
means the ranks' advantages reduce from per-row partial sums: ``assert_equal_but_reduced``);
both steps' draws stay stored; with two spawned workers (slow) the controller serialises no
payload in the policy-gradient step and fetches no stored field."""

import pytest

from tandem.data import write_parquet
from tandem.dataplane import traffic
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows
from tests.rl.test_dataplane_advantages import assert_equal_but_reduced
from tests.rl.test_dataplane_step import assert_draws_stay_stored, run

GKD = (
    "teacher.top_k=2", "algorithm.distill.objective=jsd", "algorithm.distill.beta=0",
    "algorithm.distill.reward_coef=0", "algorithm.distill.lmbda=0.5",
)  # fmt: skip


@pytest.fixture(scope="module")
def answered_rows(tmp_path_factory):
    """The arithmetic task's training rows, each with its answer as a worked response."""
    rows = arithmetic_rows(64, ArithmeticTaskConfig(max_digits=2), seed=0)
    for row in rows:
        row["extra_info"]["response"] = row["reward_model"]["ground_truth"]
    return str(write_parquet(rows, tmp_path_factory.mktemp("answered") / "train.parquet"))


def gkd(rl_files, answered_rows):
    return (*GKD, f"teacher.model_path={rl_files['model']}", f"data.train_path={answered_rows}")


def test_in_process_gkd_builds_its_dataset_step_on_the_ranks_and_matches_the_batch_path(
    rl_files,
    answered_rows,
    tmp_path,
):
    """Two GKD steps, one in-process worker: metrics equal; the dataset step's draw is a
    ``BatchRef`` like a sampled one (every token column stored, none inline), with no rollout
    log-probs stored by the draw (the step's pass makes them); every block put is released."""
    off, _ = run(rl_files, tmp_path / "off", "dataplane.enabled=false", *gkd(rl_files, answered_rows))
    counters = traffic()
    on, refs = run(rl_files, tmp_path / "on", "dataplane.enabled=true", *gkd(rl_files, answered_rows))
    used = traffic() - counters
    assert [step["distill/off_policy_step"] for step in on] == [1.0, 0.0]
    assert_equal_but_reduced(off, on)
    assert_draws_stay_stored(refs)
    dataset_step, sampled_step = refs.draws
    assert "rollout_log_probs" not in dataset_step and "rollout_log_probs" in sampled_step.stored_fields()
    assert used.blocks_released == used.blocks_put > 0
    assert refs.left == [[], []]


@pytest.mark.slow  # two 2-step runs over 2 spawned workers with a teacher: a few minutes on 2 loaded cores
def test_gkd_on_references_matches_the_batch_path_and_moves_no_payload(rl_files, answered_rows, tmp_path):
    overrides = ("trainer.n_workers=2", *gkd(rl_files, answered_rows))
    off, today = run(rl_files, tmp_path / "off", "dataplane.enabled=false", *overrides)
    on, refs = run(rl_files, tmp_path / "on", "dataplane.enabled=true", *overrides)
    assert_equal_but_reduced(off, on)
    assert_draws_stay_stored(refs)
    assert refs.left == [[], []]
    print(
        f"controller batch bytes per step: today {today.step_bytes}, refs {refs.step_bytes}; in "
        f"generation: today {today.gen_bytes}, refs {refs.gen_bytes}; fetched by the controller {refs.own_fetched}"
    )
    (dataset_today, sampled_today), (dataset_refs, sampled_refs) = today.gen_bytes, refs.gen_bytes
    dataset_batch, sampled_batch = today.batch_bytes
    assert dataset_today == 0  # today the controller builds the dataset step's batch itself ...
    assert 0 < dataset_refs < dataset_batch / 4  # ... now it sends the ranks their rows' requests only
    assert sampled_refs + sampled_batch <= sampled_today  # the generated batch no longer comes back
    assert refs.step_bytes == [0, 0]  # the policy-gradient step serialises no payload
    assert refs.own_fetched == [0, 0]  # the controller fetched no stored field (no view stage)
