"""Converters from local copies of public datasets to verl's schema (no download: bring the files).

* gsm8k (``question``, ``answer`` ending in ``#### <number>``), e.g. ``openai/gsm8k`` main parquet;
* MATH (``problem``, ``solution`` containing ``\\boxed{...}``), e.g. ``hendrycks_math`` / MATH-500.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.data.rows import read_rows
from tandem.rl.rewards.math_answers import last_boxed_content

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def _require(row: dict, names: tuple[str, ...], where: str) -> None:
    for name in names:
        if not isinstance(row.get(name), str):
            raise ValueError(f"{where}: field {name!r} must be a string (has {sorted(row)})")


def _verl_row(data_source: str, content: str, truth: str, split: str, index: int) -> dict[str, Any]:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index},
    }


def gsm8k_rows(path: str | Path, split: str = "train") -> list[dict[str, Any]]:
    """Rows of a gsm8k parquet/JSONL file in verl's schema (``data_source="openai/gsm8k"``)."""
    rows = []
    for index, row in enumerate(read_rows(path)):
        where = f"{path}: row {index}"
        _require(row, ("question", "answer"), where)
        if "####" not in row["answer"]:
            raise ValueError(f"{where}: field 'answer' has no '#### <answer>' line")
        truth = row["answer"].split("####")[-1].strip().replace(",", "")
        content = f"{row['question']} {GSM8K_INSTRUCTION}"
        rows.append(_verl_row("openai/gsm8k", content, truth, split, index))
    return rows


def math_rows(path: str | Path, split: str = "train") -> list[dict[str, Any]]:
    """Rows of a MATH parquet/JSONL file in verl's schema (``data_source="math"``); the answer is the last ``\\boxed{}``."""
    rows = []
    for index, row in enumerate(read_rows(path)):
        where = f"{path}: row {index}"
        _require(row, ("problem", "solution"), where)
        truth = (
            row.get("answer") if isinstance(row.get("answer"), str) else last_boxed_content(row["solution"])
        )
        if truth is None:
            raise ValueError(f"{where}: field 'solution' has no \\boxed{{...}} answer")
        content = f"{row['problem']} {MATH_INSTRUCTION}"
        rows.append(_verl_row("math", content, truth, split, index))
    return rows
