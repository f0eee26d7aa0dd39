"""``dataplane.enabled`` with the step stages that once rebuilt the draw on the controller: DAPO's
dynamic sampling keeps its draws in the store (the filter reads per-row scores; the kept groups
are chosen by rewriting the references' indices and the dropped draws' blocks are released), and
ReMax's greedy baselines keep their greedy responses there (only their scores reach the
controller). Each run's metrics equal the ``Batch`` path's, step for step on a fixed seed (bit
for bit, but the means the ranks' advantages reduce from per-row partial sums:
``assert_equal_but_reduced``), and, with two spawned workers (slow), the controller serialises no
payload in the policy-gradient step, and in generation no more than the requests."""

import pytest

from tandem.dataplane import traffic
from tests.rl.test_dataplane_advantages import assert_equal_but_reduced
from tests.rl.test_dataplane_step import assert_draws_stay_stored, run

HALF_FLAT = (  # a prompt of odd answer scores every response 0.5 (a group with no signal), others the digit share
    "def compute_score(data_source, solution, ground_truth, extra_info):\n"
    "    if sum(map(ord, str(ground_truth))) % 2:\n"
    "        return 0.5\n"
    "    return sum(c.isdigit() for c in solution) / max(len(solution), 1)\n"
)
DYNAMIC = ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=3")


@pytest.fixture
def half_flat_reward(tmp_path):
    path = tmp_path / "half_flat.py"
    path.write_text(HALF_FLAT)
    return f"reward.custom_path={path}"


def test_in_process_dynamic_sampling_keeps_its_draws_stored_and_matches_the_batch_path(
    rl_files, tmp_path, half_flat_reward
):
    """Two DAPO steps, one in-process worker: groups are dropped and drawn again (more than one
    draw a step), the kept ones come from several draws; metrics equal, the step's draw is a
    ``BatchRef`` with no token column inline, every block put is released, no file left."""
    off, _ = run(rl_files, tmp_path / "off", "dataplane.enabled=false", half_flat_reward, *DYNAMIC)
    counters = traffic()
    on, refs = run(rl_files, tmp_path / "on", half_flat_reward, "dataplane.enabled=true", *DYNAMIC)
    used = traffic() - counters
    assert_equal_but_reduced(off, on)
    assert [step["dynamic_sampling/gen_rounds"] for step in on] == [3.0, 2.0]  # groups drawn again
    assert_draws_stay_stored(refs)
    assert all(len(draw.blocks()) > 1 for draw in refs.draws)  # each step's rows come from several draws
    assert used.blocks_released == used.blocks_put > 0
    assert refs.left == [[], []]


def test_in_process_remax_keeps_its_draws_and_greedy_responses_stored_and_matches_the_batch_path(
    rl_files, tmp_path
):
    """Two ReMax steps, one in-process worker: metrics equal; the draw stays stored, and the greedy
    generation puts blocks of its own (one a step beside the draw's), released once scored."""
    off, _ = run(rl_files, tmp_path / "off", "dataplane.enabled=false", "preset=remax")
    counters = traffic()
    on, refs = run(rl_files, tmp_path / "on", "preset=remax", "dataplane.enabled=true")
    used = traffic() - counters
    assert_equal_but_reduced(off, on)
    assert_draws_stay_stored(refs)
    assert all("reward_baselines" in draw.scalars for draw in refs.draws)
    assert used.blocks_put >= 2 * 2  # per step: the draw's block and the greedy responses' one
    assert used.blocks_released == used.blocks_put
    assert refs.left == [[], []]


@pytest.mark.slow  # two pairs of 2-step runs over 2 spawned workers: about 3 minutes each on 2 loaded cores
@pytest.mark.parametrize("algorithm", ["dynamic-sampling", "remax"])
def test_dapo_and_remax_on_references_match_the_batch_path_and_move_no_payload(
    rl_files, tmp_path, half_flat_reward, algorithm
):
    overrides = DYNAMIC + (half_flat_reward,) if algorithm == "dynamic-sampling" else ("preset=remax",)
    off, today = run(rl_files, tmp_path / "off", "dataplane.enabled=false", "trainer.n_workers=2", *overrides)
    on, refs = run(rl_files, tmp_path / "on", "trainer.n_workers=2", "dataplane.enabled=true", *overrides)
    assert_equal_but_reduced(off, on)
    assert_draws_stay_stored(refs)
    assert refs.left == [[], []]
    print(f"controller batch bytes in generation: today {today.gen_bytes}, refs {refs.gen_bytes}")
    for gen_today, gen_refs, batch in zip(today.gen_bytes, refs.gen_bytes, today.batch_bytes, strict=True):
        assert gen_refs + batch <= gen_today  # no generated batch comes back (draws, greedy responses)
    assert refs.step_bytes == [0, 0]  # the policy-gradient step serialises no payload
