"""A synthetic multi-digit arithmetic task that needs no download, with adjustable difficulty.

A prompt asks for ``a op b [op c ...]`` written compactly (``"37+58="``); the ground truth is
the integer result. Difficulty grows with ``max_digits`` (operand size), ``num_operands`` and
the operators allowed. Rows follow verl's schema with ``data_source="arithmetic"``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tandem.config.validation import check_positive, check_range

DATA_SOURCE = "arithmetic"
OPERATORS = "+-*"


@dataclass(frozen=True)
class ArithmeticTaskConfig:
    """Difficulty of the arithmetic task.

    Attributes:
        min_digits / max_digits: operands have between these many digits.
        num_operands: numbers per expression (2: ``a+b``).
        operators: characters drawn from ``+-*``.
        allow_negative: when False, a subtraction that would go below zero swaps its operands.
        reverse_answer: the answer is written least-significant digit first (``47+85=`` -> ``231``),
            the order in which carries are computed, which small models learn far faster.
    """

    min_digits: int = 1
    max_digits: int = 2
    num_operands: int = 2
    operators: str = "+"
    allow_negative: bool = False
    reverse_answer: bool = False

    def __post_init__(self) -> None:
        check_positive("task", "min_digits", self.min_digits)
        check_range("task", "max_digits", self.max_digits, low=self.min_digits, high=9)
        check_range("task", "num_operands", self.num_operands, low=2, high=6)
        if not self.operators or set(self.operators) - set(OPERATORS):
            raise ValueError(f"task.operators={self.operators!r} must be a non-empty subset of {OPERATORS!r}")


def _operand(rng: random.Random, config: ArithmeticTaskConfig) -> int:
    digits = rng.randint(config.min_digits, config.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def make_problem(rng: random.Random, config: ArithmeticTaskConfig) -> tuple[str, int]:
    """One expression (``"37+58"``) and its value (Python's precedence)."""
    numbers = [_operand(rng, config) for _ in range(config.num_operands)]
    operators = [rng.choice(config.operators) for _ in range(config.num_operands - 1)]
    if (
        not config.allow_negative
        and config.num_operands == 2
        and operators[0] == "-"
        and numbers[0] < numbers[1]
    ):
        numbers.reverse()
    expression = str(numbers[0]) + "".join(op + str(n) for op, n in zip(operators, numbers[1:], strict=True))
    return expression, eval(expression)  # noqa: S307 — digits and +-* only, built just above


def arithmetic_rows(
    count: int, config: ArithmeticTaskConfig, seed: int, split: str = "train"
) -> list[dict[str, Any]]:
    """``count`` rows in verl's schema; the same ``seed`` gives the same rows."""
    check_positive("task", "count", count)
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        expression, value = make_problem(rng, config)
        answer = str(value)
        if config.reverse_answer:
            answer = ("-" if value < 0 else "") + str(abs(value))[::-1]
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": expression + "="}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "expression": expression,
                    "reverse_answer": config.reverse_answer,
                },
            }
        )
    return rows
