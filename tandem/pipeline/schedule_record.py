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
the training data; ``sample_log`` (when its replica keeps one) names the group's entry in the
replica's sample log beside the record (:mod:`tandem.pipeline.sample_log`), written before the
line. A step with several draws (dynamic sampling) has a line per draw; the rows the step then
keeps are the trainer's choice, which the record does not repeat. A resumed run appends to the
same file: a later line for a step replaces an earlier one (the step ran again).

Two other kinds of line make the record replayable (``pipeline.replay``,
:mod:`tandem.pipeline.replay`): ``{"run": {...}}``, the settings a replay must share with the
run (``data.train_batch_size``, ``trainer.seed``, ``algorithm.*``, ``model_path``, ...; written
when the run starts), and ``{"after_update": 3, "sampler": {...}}``, the prompt sampler's state
once the pipeline has handed out the groups that weight version 3 allows (a replay's sampler is
set to it, so the step's ``training/epoch`` and the checkpoint's sampler state are the run's).

:func:`read_schedule` reads a record's draw lines back, one dict per line; :func:`read_record`
all of it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.pipeline.sample_log import log_directory

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
        **({"sample_log": group.sample_log} if group.sample_log else {}),
    }


class ScheduleRecord:
    """Appends a line per draw to ``path`` (its directory is made); see the module docstring."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.log_directory = log_directory(path)  # the replicas' sample logs (:mod:`.sample_log`)

    def write(self, step: int, draw: int, trainer_version: int, groups: list[GroupMeta]) -> None:
        """Record that step ``step``'s ``draw``-th draw, taken with the trainer at weights
        ``trainer_version``, holds ``groups`` (in row order); on disk when this returns."""
        self._append(
            {
                "step": step,
                "draw": draw,
                "trainer_version": trainer_version,
                "groups": [group_entry(group) for group in groups],
            }
        )

    def write_run(self, settings: dict[str, Any]) -> None:
        """Record the run's ``settings`` (``{key as the user writes it: value}``) that a replay
        must share."""
        self._append({"run": settings})

    def write_sampler(self, version: int, state: dict[str, Any]) -> None:
        """Record the prompt sampler's ``state`` once the trainer's weights ``version`` were handed on."""
        self._append({"after_update": version, "sampler": state})

    def _append(self, line: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as file:
            file.write(json.dumps(line) + "\n")
            file.flush()
            os.fsync(file.fileno())


@dataclass
class Record:
    """A schedule record read back (:func:`read_record`).

    Attributes:
        draws: each ``(step, draw)``'s line (the last one written, for a step that ran again).
        runs: every ``run`` line's settings, in order (one per start of the run).
        samplers: the sampler's state after each weight version (the last one written).
    """

    draws: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    samplers: dict[int, dict[str, Any]] = field(default_factory=dict)


def _lines(path: str) -> list[dict[str, Any]]:
    """Every line of a record, in order. A last line cut short (a crash while writing it: its
    step never trained) is left out; a broken line before others is an error naming it."""
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


def read_schedule(path: str) -> list[dict[str, Any]]:
    """The draw lines of a schedule record, in order (see :func:`_lines` for a torn last line)."""
    return [line for line in _lines(path) if "step" in line]


def read_record(path: str) -> Record:
    """All of a schedule record, each kind of line by what it is about (see :class:`Record`)."""
    record = Record()
    for line in _lines(path):
        if "step" in line:
            record.draws[(line["step"], line["draw"])] = line
        elif "run" in line:
            record.runs.append(line["run"])
        elif "after_update" in line:
            record.samplers[line["after_update"]] = line["sampler"]
    return record
