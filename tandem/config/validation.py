"""Small checks used by every config's ``__post_init__``; each error names the bad field."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def check_choice(owner: str, field: str, value: Any, allowed: Iterable[Any]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``allowed``."""
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{owner}.{field}={value!r} is not allowed; choose one of {allowed}")


def check_range(
    owner: str,
    field: str,
    value: float,
    low: float | None = None,
    high: float | None = None,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    allow_inf: bool = False,
) -> None:
    """Raise ``ValueError`` unless ``low <= value <= high`` (bounds optional, inclusivity configurable).

    NaN is always refused, and ``inf``/``-inf`` too unless ``allow_inf`` (for a field whose
    documentation says ``inf`` means "no limit"); the bounds still apply to an infinite value.
    """
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{owner}.{field} must be a number, got {type(value).__name__} {value!r}")
    check_finite(owner, field, value, allow_inf=allow_inf)
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    too_high = high is not None and (value > high if high_inclusive else value >= high)
    if too_low or too_high:
        lower = "(-inf" if low is None else ("[" if low_inclusive else "(") + str(low)
        upper = "inf)" if high is None else str(high) + ("]" if high_inclusive else ")")
        raise ValueError(f"{owner}.{field}={value!r} is outside the allowed range {lower}, {upper}")


def check_positive(owner: str, field: str, value: float, *, allow_inf: bool = False) -> None:
    """Raise ``ValueError`` unless ``value > 0`` (and finite, unless ``allow_inf``)."""
    check_range(owner, field, value, low=0.0, low_inclusive=False, allow_inf=allow_inf)


def check_finite(owner: str, field: str, value: Any, *, allow_inf: bool = False) -> None:
    """Raise ``ValueError`` when ``value`` is a NaN float, or ``inf``/``-inf`` unless ``allow_inf``.

    ``owner`` may be empty when ``field`` is already the whole dotted key (``actor.engine.lr``).
    """
    if not isinstance(value, float) or math.isfinite(value) or (allow_inf and not math.isnan(value)):
        return
    key = f"{owner}.{field}" if owner else field
    allowed = "a number or inf (no limit)" if allow_inf else "a finite number"
    raise ValueError(f"{key}={value!r} is not allowed: it must be {allowed}")
