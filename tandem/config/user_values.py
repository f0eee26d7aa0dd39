"""What a user's function (a reward function, an agent interaction) may return as a number:
every real type, nothing else.

Python ``int``/``float``/``bool``, numpy scalars (``np.float32(0.5)``, ``np.int64``,
``np.bool_``), and 0-d or one-element numpy arrays and torch tensors of a real dtype are
numbers. Strings, ``None``, complex values, larger arrays, NaN/inf and integers too large for
a float are not: the callers count those as errors instead of training on them.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch


def real_number(value: Any) -> float | None:
    """``value`` as a finite float, or ``None`` when it is not a finite real number."""
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    try:
        if isinstance(value, numbers.Real):
            number = float(value)
        elif isinstance(value, (np.ndarray, torch.Tensor)) and _one_real(value):
            number = float(value.item())
        else:
            return None
    except OverflowError:  # an int of 400 digits
        return None
    return number if math.isfinite(number) else None


def _one_real(array: np.ndarray | torch.Tensor) -> bool:
    """A 0-d or one-element array or tensor of a real (not complex) dtype."""
    if array.ndim > 1 or math.prod(array.shape) != 1:
        return False
    if isinstance(array, torch.Tensor):
        return not array.is_complex()
    return array.dtype.kind in "biuf"


def describe(value: Any) -> str:
    """A short account of a value that is not a usable number (for error messages)."""
    if isinstance(value, (float, np.floating)) and not math.isfinite(float(value)):
        return repr(float(value))
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return f"{type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"
