"""The run loop every trainer shares: step, validate and checkpoint on schedule, log every step.

A trainer (RL, SFT, DPO, reward model) provides only what differs: its step, its validation and
its checkpoint (:class:`Steps`). :func:`run_steps` decides when each runs (:class:`Schedule`),
and :class:`RunRecord` keeps what was logged: every step's metrics in ``history``, handed to the
run's trackers, with the step recorded in ``status.json``. :func:`recording` brackets the loop:
``status.json`` says ``running``, then ``finished`` or ``failed``, and the trackers close.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from tandem.run.trackers import Tracker


@dataclass(frozen=True)
class Schedule:
    """When a run of ``total_steps`` steps validates and saves.

    Attributes:
        total_steps: the step the run ends after.
        validate_every / save_every: every this many steps (0: only after the last step).
        validates: whether the run has validation data at all.
        validate_first: validate before the first step too (a run that starts fresh).
    """

    total_steps: int
    validate_every: int
    save_every: int
    validates: bool
    validate_first: bool = False

    def validates_after(self, step: int) -> bool:
        return self.validates and (_every(self.validate_every, step) or step == self.total_steps)

    def saves_after(self, step: int) -> bool:
        return _every(self.save_every, step) or step == self.total_steps


def _every(interval: int, step: int) -> bool:
    return bool(interval) and step % interval == 0


class Steps(Protocol):
    """What a trainer gives the loop. ``step`` counts the steps taken (a resumed run's to start)."""

    step: int

    def train_step(self) -> dict[str, float]:
        """Take one step (counting it in ``step``); its metrics."""
        ...

    def validate(self) -> dict[str, float]:
        """The validation metrics logged with the current step."""
        ...

    def save_checkpoint(self) -> Path:
        """Save what resuming at the current step needs."""
        ...


class RunRecord:
    """What a run logged: ``history`` (every step's metrics with its ``step``), ``validation``
    (the last validation's metrics); each logged step goes to every tracker and into
    ``status.json`` (``run_info.progress``). Non-finite metrics are named on the console."""

    def __init__(self, trackers: list[Tracker], run_info: Any, console: Console) -> None:
        self.trackers = trackers
        self.run_info = run_info
        self.console = console
        self.history: list[dict[str, float]] = []
        self.validation: dict[str, float] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        bad = sorted(name for name, value in metrics.items() if not math.isfinite(value))
        if bad:
            self.console.print(f"[red]step {step}: non-finite metrics {bad}")
        self.history.append({"step": step, **metrics})
        for tracker in self.trackers:
            tracker.log(metrics, step)
        self.run_info.progress(step)


@contextlib.contextmanager
def recording(
    run_info: Any, trackers: list[Tracker], start_step: int, console: Console
) -> Iterator[RunRecord]:
    """A :class:`RunRecord` over ``trackers`` for the loop's duration, inside ``status.json``'s
    running / finished / failed bracket; the trackers close after, whatever happened. When the
    loop failed, a tracker that cannot close (a full disk) is one line on stderr, not a new error."""
    failed = False
    try:
        with run_info.running(start_step):
            yield RunRecord(trackers, run_info, console)
    except BaseException:
        failed = True
        raise
    finally:
        for tracker in trackers:
            try:
                tracker.close()
            except OSError as error:  # a full disk, say: the error that stopped the run comes first
                if not failed:
                    raise
                print(f"tandem: {type(tracker).__name__} could not close: {error}", file=sys.stderr)


def run_steps(
    trainer: Steps,
    schedule: Schedule,
    record: RunRecord,
    around_step: Callable[[int], AbstractContextManager[Any]] = lambda step: contextlib.nullcontext(),
) -> None:
    """Step until ``schedule.total_steps``: validate and checkpoint on schedule (and after the last
    step), log every step. ``around_step(k)`` wraps step ``k`` (the RL trainer's profiler)."""
    if schedule.validates and schedule.validate_first and trainer.step == 0:
        record.validation = trainer.validate()
        record.log(0, record.validation)
    while trainer.step < schedule.total_steps:
        with around_step(trainer.step + 1):
            metrics = trainer.train_step()
        if schedule.validates_after(trainer.step):
            record.validation = trainer.validate()
            metrics.update(record.validation)
        record.log(trainer.step, metrics)
        if schedule.saves_after(trainer.step):
            trainer.save_checkpoint()


class EveryNthStep:
    """A tracker that prints ``line(step, metrics)`` every ``every`` steps, after the last step,
    and with every validation (``validation_key`` among the metrics)."""

    def __init__(
        self,
        console: Console,
        every: int,
        total_steps: int,
        validation_key: str,
        line: Callable[[int, dict[str, float]], str],
    ) -> None:
        self.console, self.every, self.total_steps = console, every, total_steps
        self.validation_key, self.line = validation_key, line

    def log(self, metrics: dict[str, float], step: int) -> None:
        if step % self.every == 0 or step == self.total_steps or self.validation_key in metrics:
            self.console.print(self.line(step, metrics))

    def close(self) -> None:
        pass
