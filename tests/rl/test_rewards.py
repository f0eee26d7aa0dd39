"""Rewards: built-in scorers, user functions from a file, timeouts and errors that never stop scoring."""

import time

import pytest
import torch

from tandem.rl.config import OverlongPenaltyConfig, RewardConfig
from tandem.rl.rewards import SCORERS, RewardManager, run_with_timeouts
from tandem.rl.rewards.math_answers import last_boxed_content


def test_arithmetic_scorer_gives_exact_accuracy_and_per_digit_credit():
    score = SCORERS.get("arithmetic")
    assert score(" 123 ", "123", {}) == {"score": 1.0, "acc": 1.0}
    assert score("124", "123", {}) == {"score": pytest.approx(2 / 3), "acc": 0.0}
    assert score("23", "123", {}) == {"score": pytest.approx(2 / 3), "acc": 0.0}  # aligned from the units
    assert score("1x3", "123", {}) == {"score": 0.0, "acc": 0.0}
    assert score("", "5", {}) == {"score": 0.0, "acc": 0.0}
    reverse = {"reverse_answer": True}  # "321" is 123 written units first: align from the start
    assert score("32", "321", reverse) == {"score": pytest.approx(2 / 3), "acc": 0.0}
    assert score("321", "321", reverse) == {"score": 1.0, "acc": 1.0}


def test_gsm8k_and_math_scorers():
    gsm8k = SCORERS.get("openai/gsm8k")
    assert gsm8k("so 3 + 4 = 7\n#### 1,007", "1007", {}) == 1.0
    assert gsm8k("#### 8", "7", {}) == 0.0
    assert gsm8k("the answer is 7", "7", {}) == 1.0
    math = SCORERS.get("math")
    assert math("thus $\\boxed{\\dfrac{1}{2}}$", "\\frac{1}{2}", {}) == 1.0
    assert math("thus $\\boxed{3}$", "4", {}) == 0.0
    assert math("no box", "4", {}) == 0.0
    assert last_boxed_content("a \\boxed{x^{2}} b \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"


def test_parallel_scoring_matches_a_sequential_loop_and_survives_errors_and_hangs():
    def fn(i):
        if i == 3:
            raise RuntimeError("boom")
        if i == 5:
            time.sleep(60)  # hangs: must time out without blocking the rest or the interpreter's exit
        return i * i

    started = time.monotonic()
    results = run_with_timeouts(fn, [(i,) for i in range(12)], num_threads=3, timeout_s=0.5)
    assert time.monotonic() - started < 5
    for i, result in enumerate(results):
        if i == 3:
            assert result.error == "RuntimeError: boom" and not result.timeout
        elif i == 5:
            assert result.timeout and "timed out" in result.error
        else:
            assert result.error is None and result.value == i * i


def test_reward_manager_with_a_user_function_counts_failures(tmp_path):
    source = tmp_path / "my_reward.py"
    source.write_text(
        "import time\n"
        "def score(data_source, solution, ground_truth, extra_info):\n"
        "    if solution == 'raise':\n"
        "        raise ValueError('bad')\n"
        "    if solution == 'hang':\n"
        "        time.sleep(60)\n"
        "    if solution == 'text':\n"
        "        return 'not a number'\n"
        "    return {'score': float(solution == ground_truth), 'length': len(solution)}\n"
    )
    manager = RewardManager(RewardConfig(custom_path=str(source), custom_name="score", timeout_s=0.5))
    solutions = ["7", "8", "raise", "hang", "text"]
    result = manager.score(["any"] * 5, solutions, ["7"] * 5, [{}] * 5, torch.ones(5), 8)
    assert result.scores.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert result.metrics["reward/errors"] == 3 and result.metrics["reward/timeouts"] == 1
    assert result.metrics["reward/extra/length/mean"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="defines no function 'nope'"):
        RewardManager(RewardConfig(custom_path=str(source), custom_name="nope"))


def test_unknown_data_source_is_caught_before_training():
    with pytest.raises(ValueError, match="unknown reward scorer 'my_dataset'"):
        RewardManager(RewardConfig()).check_sources(["arithmetic", "my_dataset"])


def test_overlong_penalty_matches_the_dapo_formula():
    config = RewardConfig(overlong=OverlongPenaltyConfig(enable=True, buffer=4, penalty_factor=0.5))
    lengths = torch.tensor([2, 12, 13, 14, 16])
    result = RewardManager(config).score(["arithmetic"] * 5, ["5"] * 5, ["5"] * 5, [{}] * 5, lengths, 16)
    # expected length 16 - 4 = 12; penalty = -min((len - 12) / 4, 1) * 0.5
    expected = [1.0 - min(max(n - 12, 0) / 4, 1) * 0.5 for n in lengths.tolist()]
    assert result.scores.tolist() == pytest.approx(expected)
    assert result.accuracy.tolist() == [1.0] * 5


def test_math_scorer_uses_symbolic_equivalence_when_math_verify_is_installed():
    pytest.importorskip("math_verify")
    math = SCORERS.get("math")
    assert math("so $\\boxed{0.5}$", "\\frac{1}{2}", {}) == 1.0  # a string comparison would say no
    assert math("so $\\boxed{0.6}$", "\\frac{1}{2}", {}) == 0.0
