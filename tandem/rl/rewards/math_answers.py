"""Answer extraction and comparison for math-style responses (gsm8k ``####``, MATH ``\\boxed{}``, plain numbers)."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    index = text.index("{", start) + 1
    depth = 1
    for position in range(index, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[index:position]
    return None


def last_number(text: str) -> str | None:
    """The last integer or decimal in ``text`` with thousands separators removed; None if there is none."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def numbers_equal(a: str, b: str) -> bool:
    """Numeric equality of two number strings (``"3.0" == "3"``); False when either is not a number."""
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def normalize_latex(answer: str) -> str:
    """A light normal form for comparing short LaTeX answers without a CAS."""
    answer = answer.strip().strip("$").replace(" ", "").replace("\\!", "")
    answer = (
        answer.replace("\\left", "").replace("\\right", "").replace("dfrac", "frac").replace("tfrac", "frac")
    )
    answer = re.sub(r"\\text\{(.*?)\}", r"\1", answer)
    return answer.rstrip(".")
