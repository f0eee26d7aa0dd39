"""Built-in scorers, registered by ``data_source``: arithmetic, gsm8k, MATH and shapes.

A scorer is ``fn(solution_str, ground_truth, extra_info) -> float`` (1.0 correct, 0.0 not),
or a dict with the ``score`` to train on and the exact ``acc``; the reward manager picks one
by each sample's ``data_source``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from tandem.registry import Registry
from tandem.rl.rewards.math_answers import last_boxed_content, last_number, normalize_latex, numbers_equal

Scorer = Callable[[str, str, dict], float | dict[str, float]]
SCORERS: Registry[Scorer] = Registry("reward scorer")


def register_scorer(*data_sources: str) -> Callable[[Scorer], Scorer]:
    """Register a scorer under one or more ``data_source`` names."""

    def decorate(fn: Scorer) -> Scorer:
        for name in data_sources:
            SCORERS.register(name)(fn)
        return fn

    return decorate


@register_scorer("arithmetic")
def arithmetic_score(solution: str, ground_truth: str, extra_info: dict) -> dict[str, float]:
    """Exact match of the integer answer (``acc``), with partial credit per digit as the ``score``.

    The score is the fraction of digit places (aligned from the units, which come first when
    ``extra_info["reverse_answer"]``) that match, over the longer of the two numbers, so it is
    1 exactly when the answer is right. The dense credit
    gives GRPO a signal on each place long before whole answers are right; accuracy stays exact.
    """
    answer, truth = solution.strip(), ground_truth.strip()
    exact = float(answer == truth)
    if not answer.lstrip("-").isdigit():
        return {"score": 0.0, "acc": 0.0}
    if not (extra_info or {}).get("reverse_answer"):
        answer, truth = answer[::-1], truth[::-1]
    matching = sum(a == b for a, b in zip(answer, truth, strict=False))
    return {"score": matching / max(len(answer), len(truth)), "acc": exact}


@register_scorer("openai/gsm8k", "gsm8k")
def gsm8k_score(solution: str, ground_truth: str, extra_info: dict) -> float:
    """1 when the number after the last ``####`` (else the last number) equals the ground truth."""
    tail = solution.split("####")[-1] if "####" in solution else solution
    answer = last_number(tail)
    return float(answer is not None and numbers_equal(answer, ground_truth.replace(",", "")))


@register_scorer(
    "math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math_dapo"
)
def math_score(solution: str, ground_truth: str, extra_info: dict) -> float:
    """1 when the last ``\\boxed{}`` answer is equivalent to the ground truth.

    Uses ``math-verify`` (symbolic equivalence) when it is installed, else a normalised
    string / numeric comparison.
    """
    answer = last_boxed_content(solution)
    if answer is None:
        return 0.0
    try:
        from math_verify import parse, verify
    except ImportError:
        a, b = normalize_latex(answer), normalize_latex(ground_truth)
        return float(a == b or numbers_equal(a, b))
    return float(verify(parse(f"${ground_truth}$"), parse(f"\\boxed{{{answer}}}")))


NUMBER_WORDS = {"zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5"}


def one_word_answer(solution: str) -> str:
    """The answer of a reply asked for one word: the first word of its last non-empty line,
    lowercased, without surrounding punctuation, a number word as its digit ("Two." -> "2")."""
    lines = [line for line in solution.strip().splitlines() if line.strip()]
    words = lines[-1].split() if lines else []
    word = re.sub(r"^\W+|\W+$", "", words[0].lower()) if words else ""
    return NUMBER_WORDS.get(word, word)


@register_scorer("shapes")
def shapes_score(solution: str, ground_truth: str, extra_info: dict) -> float:
    """1 when the reply's one-word answer (:func:`one_word_answer`) is the ground truth exactly
    (the ``shapes`` task: a digit, a colour, or yes/no)."""
    return float(one_word_answer(solution) == ground_truth.strip().lower())
