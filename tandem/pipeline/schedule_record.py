"""The run's schedule record (``pipeline.record_schedule``): which samples each step trained on.

In ``one_step_off`` and ``fully_async`` the samples a step trains on depend on timing (which
replica finished first, which weights each token was sampled under). :class:`ScheduleRecord`
writes down, for every draw the trainer takes, the prompt groups it holds in row order, one JSON
object a line, appended, flushed and synced to disk before the step trains on them, so that a
crash loses nothing already trained:

``{"step": 3, "draw": 1, "trainer_version": 2, "groups": [{"uid": "g7", "index": 12,
"replica": 0, "replica_generation": 0, "min_version": 1, "max_version": 2, "seeds": [...],
"request_ids": ["g7/0", ...], "finish_reasons": ["stop", ...]}, ...]}``

Each group stands for its ``n`` rows (one per seed, in order); ``index`` is the prompt's row in
the training data. A step with several draws (dynamic sampling) has a line per draw; the rows the
step then keeps are the trainer's choice, which the record does not repeat. A resumed run appends
to the same file: a later line for a step replaces an earlier one (the step ran again).
:func:`read_schedule` reads a record back, one dict per line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.pipeline.sample_queue import GroupMeta


def group_entry(group: GroupMeta) -> dict[str, Any]:
    """What the record holds of one prompt group (see the module docstring)."""
    return {
        "uid": group.uid,
        "index": group.index,
        "replica": group.replica,
        "replica_generation": group.generation,
        "min_version": group.min_version,
        "max_version": group.max_version,
        "seeds": list(group.seeds),
        "request_ids": list(group.request_ids),
        "finish_reasons": list(group.finish_reasons),
    }


class ScheduleRecord:
    """Appends a line per draw to ``path`` (its directory is made); see the module docstring."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, draw: int, trainer_version: int, groups: list[GroupMeta]) -> None:
        """Record that step ``step``'s ``draw``-th draw, taken with the trainer at weights
        ``trainer_version``, holds ``groups`` (in row order); on disk when this returns."""
        line = {
            "step": step,
            "draw": draw,
            "trainer_version": trainer_version,
            "groups": [group_entry(group) for group in groups],
        }
        with self.path.open("a", encoding="utf-8") as file:
            file.write(json.dumps(line) + "\n")
            file.flush()
            os.fsync(file.fileno())


def read_schedule(path: str) -> list[dict[str, Any]]:
    """The lines of a schedule record, in order. A last line cut short (a crash while writing it:
    its step never trained) is left out; a broken line before others is an error naming it."""
    texts = Path(path).read_text(encoding="utf-8").splitlines()
    lines = []
    for number, text in enumerate(texts, start=1):
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError as error:
            if number == len(texts):
                break
            raise ValueError(f"{path}, line {number}: not a schedule record line ({error})") from error
    return lines
