"""A trainer mixin that records, around each training step, what the controller moved: the batch
bytes it serialised or rebuilt (:func:`tandem.protocol.traffic.batch_traffic`, the issue's
"payload bytes handled by the controller"), this process's data-plane counters, and the block
files of the run's processes (controller and ranks) still in ``/dev/shm`` once the step returned.
"""

import os
from pathlib import Path

from tandem.dataplane import traffic
from tandem.dataplane.shm import PREFIX
from tandem.protocol.traffic import batch_traffic


class CountingSteps:
    """Mix in before a trainer class: ``class Counting(CountingSteps, SFTTrainer)``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_bytes: list[int] = []  # controller batch bytes per step
        self.step_traffic: list = []  # this process's data-plane counters per step
        self.left: list[list[str]] = []  # block files of the run's processes after each step
        # (an in-process worker is this process, whose earlier tests' files are not this run's)
        self._before = {p.name for p in Path("/dev/shm").glob(f"{PREFIX}-*")}

    def train_step(self):
        before, counters = batch_traffic(), traffic()
        metrics = super().train_step()
        self.step_bytes.append((batch_traffic() - before).total)
        self.step_traffic.append(traffic() - counters)
        pids = {os.getpid(), *getattr(self.group.backend, "host_pids", [])}
        files = [p.name for p in Path("/dev/shm").glob(f"{PREFIX}-*") if p.name not in self._before]
        self.left.append(sorted(f for f in files for pid in pids if f.startswith(f"{PREFIX}-{pid}-")))
        return metrics


def measured(history: list[dict]) -> list[dict]:
    """Every metric but the wall-clock ones (compared bit for bit between the two paths)."""
    return [
        {k: v for k, v in step.items() if not k.startswith(("timing_s", "perf/")) and not k.endswith("_s")}
        for step in history
    ]
