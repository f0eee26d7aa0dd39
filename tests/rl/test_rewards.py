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


def test_a_reward_function_that_exits_is_an_error_at_once_not_a_timeout():
    """``SystemExit`` (or ``KeyboardInterrupt``) from user code is reported like any exception
    (:mod:`tandem.user_calls`): the run goes on and no call waits for its time limit."""

    def fn(i):
        if i == 1:
            raise SystemExit(3)
        return i

    started = time.monotonic()
    results = run_with_timeouts(fn, [(i,) for i in range(3)], num_threads=2, timeout_s=30)
    assert time.monotonic() - started < 5
    assert [(r.value, r.error, r.timeout) for r in results] == [
        (0, None, False),
        (None, "SystemExit: 3", False),
        (2, None, False),
    ]


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


def test_requested_reward_components_come_back_per_item_and_a_missing_one_is_named(tmp_path):
    source = tmp_path / "parts.py"
    source.write_text(
        "def score(data_source, solution, ground_truth, extra_info):\n"
        "    if solution == 'raise':\n"
        "        raise ValueError('bad')\n"
        "    if solution == 'plain':\n"
        "        return 0.5\n"
        "    if solution == 'short':\n"
        "        return {'score': 1.0, 'format': 1}\n"
        "    if solution == 'nan':\n"
        "        return {'score': 1.0, 'format': float('nan'), 'answer': 0.0}\n"
        "    return {'score': 0.1, 'answer': float(solution == ground_truth), 'format': len(solution)}\n"
    )
    manager = RewardManager(RewardConfig(custom_path=str(source), custom_name="score"))

    def score(solutions, keys=("answer", "format")):
        n = len(solutions)
        return manager.score(["src"] * n, solutions, ["7"] * n, [{}] * n, torch.ones(n), 8, keys)

    result = score(["7", "88", "raise"])
    # the failed item (it raised) is scored 0 and counted; its components are 0 too
    assert result.components.tolist() == [[1.0, 1.0], [0.0, 2.0], [0.0, 0.0]]
    assert result.metrics["reward/errors"] == 1 and result.scores.tolist() == pytest.approx([0.1, 0.1, 0.0])
    assert score(["7"], keys=()).components is None
    missing = (
        r"item 1 \(src\): the reward function's result has no field 'answer' \(algorithm.gdpo_reward_keys\)"
    )
    with pytest.raises(ValueError, match=missing + r"; it returned the fields \['format', 'score'\]"):
        score(["7", "short"])
    with pytest.raises(ValueError, match=r"needs the reward function to return a dict .* returned float 0.5"):
        score(["plain"])
    with pytest.raises(
        ValueError, match=r"field 'format' \(algorithm.gdpo_reward_keys\) is nan, not a finite"
    ):
        score(["nan"])


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


REAL_AND_NOT = """
import math
import numpy as np
import torch

RETURNS = {
    "np32": np.float32(0.5), "np64": np.float64(0.25), "npint": np.int64(1), "npbool": np.bool_(True),
    "array0d": np.array(0.75), "tensor0d": torch.tensor(0.5), "tensor1": torch.tensor([0.125]),
    "bf16": torch.tensor(0.5, dtype=torch.bfloat16), "int": 1, "bool": False,
    "nan": float("nan"), "inf": math.inf, "npnan": np.float32("nan"), "str": "0.5", "none": None,
    "complex": 1 + 2j, "vector": np.array([0.5, 0.5]), "huge": 10**400,
    "dict_ok": {"score": np.float32(1.0), "acc": torch.tensor(0.0), "steps": np.int64(3)},
    "dict_bad_field": {"score": 0.5, "note": "abc", "acc": "yes", "steps": float("nan")},
    "dict_bad_score": {"score": "x"},
    "dict_no_score": {"acc": 1.0},
}


def score(data_source, solution, ground_truth, extra_info):
    return RETURNS[solution]
"""

EXPECTED = {  # solution -> (score, acc, counted as a reward error)
    "np32": (0.5, 0.5, False), "np64": (0.25, 0.25, False), "npint": (1.0, 1.0, False),
    "npbool": (1.0, 1.0, False), "array0d": (0.75, 0.75, False), "tensor0d": (0.5, 0.5, False),
    "tensor1": (0.125, 0.125, False), "bf16": (0.5, 0.5, False), "int": (1.0, 1.0, False),
    "bool": (0.0, 0.0, False), "nan": (0.0, 0.0, True), "inf": (0.0, 0.0, True), "npnan": (0.0, 0.0, True),
    "str": (0.0, 0.0, True), "none": (0.0, 0.0, True), "complex": (0.0, 0.0, True), "vector": (0.0, 0.0, True),
    "huge": (0.0, 0.0, True),
    "dict_ok": (1.0, 0.0, False), "dict_bad_field": (0.5, 0.5, False), "dict_bad_score": (0.0, 0.0, True),
    "dict_no_score": (0.0, 0.0, True),
}  # fmt: skip


@pytest.mark.parametrize("num_workers", [1, 4])
def test_every_real_number_type_scores_and_everything_else_is_a_counted_error(tmp_path, num_workers):
    source = tmp_path / "returns.py"
    source.write_text(REAL_AND_NOT)
    config = RewardConfig(custom_path=str(source), custom_name="score", num_workers=num_workers)
    solutions = list(EXPECTED)
    count = len(solutions)
    result = RewardManager(config).score(
        ["src"] * count, solutions, [""] * count, [{}] * count, torch.ones(count), 8
    )
    assert result.scores.tolist() == [EXPECTED[s][0] for s in solutions]
    assert result.accuracy.tolist() == [EXPECTED[s][1] for s in solutions]
    failed = [s for s in solutions if EXPECTED[s][2]]
    assert result.metrics["reward/errors"] == len(failed) == len(result.errors)
    assert [int(e.split()[1]) for e in result.errors] == [
        solutions.index(s) for s in failed
    ]  # "item <i> (src): ..."
    assert any("returned nan" in e for e in result.errors)
    assert any("dict without 'score'" in e for e in result.errors)
    # the bad dict's extra fields are left out and counted; its score stands
    assert result.metrics["reward/invalid_fields"] == 3 and len(result.notes) == 3
    assert any("field 'note' is str 'abc'" in n for n in result.notes)
    assert result.metrics["reward/extra/steps/mean"] == 3.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("def score(a, b, c, d):\n    return (1\n", r"line \d: SyntaxError: "),
        (
            "import os\nimport not_a_module_anywhere\n",
            r"line 2: ModuleNotFoundError: No module named 'not_a_module_anywhere'",
        ),
        ("x = 1\ny = 1 / 0\n", r"line 2: ZeroDivisionError: division by zero"),
    ],
)
def test_a_reward_file_that_fails_to_load_names_the_file_and_line(tmp_path, text, message):
    source = tmp_path / "broken.py"
    source.write_text(text)
    with pytest.raises(ValueError, match=rf"reward.custom_path='{source}': {message}"):
        RewardManager(RewardConfig(custom_path=str(source), custom_name="score"))
