"""A run's own record beside its metrics: ``run.json`` says what produced it, ``status.json``
where it is.

``run.json`` (written when the run starts): experiment and project names, the trainer and the
command line, the resolved config, the model and data files, package versions, the machine,
and when it started (a resumed run keeps the first start and adds to ``resumed_at``). ``status.json`` (rewritten
after every step, atomically): ``running`` / ``finished`` / ``failed``, the step, the total,
the last update, an ETA, the error that stopped a failed run, and the process writing it (pid,
host, boot and start time). The report reads both; a user can watch ``status.json`` (or the
report, which refreshes itself) during a long run.

A process killed outright (``kill -9``, the OOM killer, a lost node) leaves ``running`` behind.
:func:`settled_status` reads such a file as ``interrupted`` once the recorded process is gone
from this machine, so the report says so and stops reloading; the next run in that directory
(a resume) records the interruption in ``run.json`` and says it on stderr.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tandem.processes import process_gone, process_identity
from tandem.report.machine import machine_facts, package_versions

RUN_FILE = "run.json"
STATUS_FILE = "status.json"


def now_iso() -> str:
    """The current UTC time as ISO 8601 (seconds)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def invocation() -> str:
    """The command line that started this process (``python -m tandem`` for the module form)."""
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    if program == "__main__.py":
        program = f"python -m {os.path.basename(os.path.dirname(sys.argv[0]))}"
    return " ".join([program, *(shlex.quote(arg) for arg in sys.argv[1:])])


def write_json_atomically(path: Path, value: dict) -> None:
    """Write ``value`` to ``path`` so a reader sees the old file or the new one, never half of one."""
    staging = path.with_name(path.name + ".tmp")
    try:
        staging.write_text(json.dumps(value, indent=1, default=str))
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)  # a full disk leaves no empty ``.tmp`` behind
        raise


def read_json(path: Path) -> dict:
    """The JSON object in ``path``, or ``{}`` when the file is missing or unreadable."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def settled_status(status: dict) -> dict:
    """``status`` as read, or, when it says ``running`` but its process is gone (:func:`tandem.processes.process_gone`),
    a copy marked ``interrupted`` with an ``error`` that says which process and when it last wrote."""
    if status.get("status") != "running" or not process_gone(status):
        return status
    return {
        **status,
        "status": "interrupted",
        "error": (
            f"process {status['pid']} on {status['host']} is gone: it stopped without recording how "
            f"(killed, or the machine went down) after its last update at {status.get('updated_at')}"
        ),
    }


class RunInfo:
    """Writes ``run.json`` and ``status.json`` into ``output_dir`` for one run (see the module docstring).

    Args:
        output_dir: the run's output directory.
        trainer: what trained, in words (``RL: grpo advantages, vanilla policy loss``); the
            process's command line is recorded beside it.
        experiment / project: the names the report's legend and title use.
        config: the resolved config as a nested dict.
        model_path: the model the run started from.
        data_files: role -> path (``{"train": ..., "val": ...}``).
        total_steps: the planned number of steps.
    """

    def __init__(
        self,
        output_dir: Path,
        trainer: str,
        experiment: str,
        project: str,
        config: dict,
        model_path: str,
        data_files: dict[str, str | None],
        total_steps: int,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.total_steps = total_steps
        self.info = {
            "experiment": experiment,
            "project": project,
            "trainer": trainer,
            "command_line": invocation(),
            "model_path": model_path,
            "data_files": {role: path for role, path in data_files.items() if path},
            "total_steps": total_steps,
            "versions": package_versions(),
            "machine": machine_facts(),
            "config": config,
        }
        self._clock_start = time.monotonic()
        self._start_step = self._step = 0
        self._started_at = ""
        self._process = process_identity()

    @contextlib.contextmanager
    def running(self, step: int) -> Iterator[None]:
        """Around the training loop: marks the run as started (or resumed at ``step``), then as
        finished when the block ends, or as failed with the error that left it (re-raised)."""
        self.start(step)
        try:
            yield
        except BaseException as error:
            try:
                self.finish(error)
            except OSError as unrecorded:  # a full disk: say so, and let the run's own error through
                print(
                    f"tandem: could not mark the run failed in {self.output_dir / STATUS_FILE}: {unrecorded}",
                    file=sys.stderr,
                )
            raise
        self.finish()

    def start(self, step: int) -> None:
        """Record the start (or a resume at ``step``) and mark the run as running."""
        previous = read_json(self.output_dir / RUN_FILE) if step > 0 else {}
        self._started_at = previous.get("started_at") or now_iso()
        self.info["started_at"] = self._started_at
        if previous:
            self.info["resumed_at"] = [*previous.get("resumed_at", []), {"step": step, "time": now_iso()}]
        interrupted = self._interrupted_before()
        if interrupted and previous:
            self.info["interrupted"] = [*previous.get("interrupted", []), interrupted]
        self._clock_start, self._start_step, self._step = time.monotonic(), step, step
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomically(self.output_dir / RUN_FILE, self.info)
        self._write_status("running")

    def _interrupted_before(self) -> dict | None:
        """The previous run in this directory, when ``status.json`` shows it stopped without a word:
        ``{"step", "pid", "last_update"}``, also said on stderr. None otherwise."""
        status = settled_status(read_json(self.output_dir / STATUS_FILE))
        if status.get("status") != "interrupted":
            return None
        print(
            f"tandem: the previous run in {self.output_dir} stopped at step {status.get('step')} without "
            f"finishing (process {status['pid']} is gone; last update {status.get('updated_at')})",
            file=sys.stderr,
        )
        return {"step": status.get("step"), "pid": status["pid"], "last_update": status.get("updated_at")}

    def progress(self, step: int) -> None:
        """After each logged step: the step and an ETA from the pace since this process started."""
        self._step = step
        self._write_status("running")

    def finish(self, error: BaseException | None = None) -> None:
        """The run ended, normally (``error`` None) or by ``error``, at the last logged step."""
        extra = {"ended_at": now_iso()}
        if error is not None:
            extra["error"] = f"{type(error).__name__}: {error}"
        self._write_status("failed" if error is not None else "finished", extra)

    def _write_status(self, status: str, extra: dict | None = None) -> None:
        step = self._step
        elapsed = time.monotonic() - self._clock_start
        done = step - self._start_step
        eta = elapsed / done * (self.total_steps - step) if done > 0 and status == "running" else None
        write_json_atomically(
            self.output_dir / STATUS_FILE,
            {
                "status": status,
                "step": step,
                "total_steps": self.total_steps,
                "started_at": self._started_at,
                "updated_at": now_iso(),
                "elapsed_s": round(elapsed, 1),
                "eta_s": None if eta is None else round(eta, 1),
                **self._process,
                **(extra or {}),
            },
        )
