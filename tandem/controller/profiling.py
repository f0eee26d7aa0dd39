"""``ProfilesCalls``: a worker mixin that records PyTorch profiler traces on request.

The controller brackets the work it wants to see with ``start_profile(directory)`` and
``stop_profile()`` on a group; every rank then writes ``<directory>/<profile_name><N>.json``
(``rank<N>`` for trainer workers, ``replica<N>`` for rollout replicas), a Chrome trace (open
it in ``chrome://tracing`` or https://ui.perfetto.dev). Each worker call shows as
a range named after its method (``update_actor``, ``compute_log_prob``, ...: see
:meth:`tandem.controller.worker.Worker._tandem_execute`), with the operators it ran inside.
Every thread of the process is recorded (a replica's engine generates on a thread of its own).
On a rank that has initialised CUDA the profiler records CUDA activity too (not yet run on a GPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity

from tandem.controller.decorator import register


class ProfilesCalls:
    """Worker methods ``start_profile`` / ``stop_profile`` (see the module docstring)."""

    rank: int
    profile_name = "rank"  # the trace file's name before the rank
    _profiler: Any = None
    _profile_dir: Path | None = None

    @register(dispatch="ONE_TO_ALL")
    def start_profile(self, directory: str) -> None:
        """Start recording; ``stop_profile`` writes ``<directory>/<profile_name><N>.json``."""
        if self._profiler is not None:
            raise RuntimeError(f"rank {self.rank} is already profiling into {self._profile_dir}")
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        self._profile_dir = Path(directory)
        self._profiler = torch.profiler.profile(activities=activities, **_all_threads())
        self._profiler.start()

    @register(dispatch="ONE_TO_ALL")
    def stop_profile(self) -> str:
        """Stop recording and write this rank's trace; returns its path."""
        if self._profiler is None or self._profile_dir is None:
            raise RuntimeError(f"rank {self.rank} is not profiling (start_profile first)")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self._profile_dir.mkdir(parents=True, exist_ok=True)
        path = self._profile_dir / f"{self.profile_name}{self.rank}.json"
        profiler.export_chrome_trace(str(path))
        return str(path)


def _all_threads() -> dict[str, Any]:
    """Profiler arguments that record every thread, not only those the profiler starts on
    (PyTorch's experimental ``profile_all_threads``; empty where this PyTorch lacks it)."""
    try:
        return {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except (AttributeError, TypeError):
        return {}
