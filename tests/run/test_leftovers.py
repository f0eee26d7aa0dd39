"""Shared-memory files of a killed run are removed by the next run in its output directory, and
nothing else is: not a live process's files, not an unrecorded process's, not another boot's."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

from tandem.processes import pid_unused
from tandem.rl import RLTrainer
from tandem.run.leftovers import RECORD, record_processes, remove_leftovers
from tests.conftest import ROOT
from tests.rl.conftest import small_config


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_the_files_of_recorded_processes_that_are_gone_are_removed(tmp_path):
    shm, run = tmp_path / "shm", tmp_path / "run"
    shm.mkdir()
    run.mkdir()
    dead, alive, unrecorded = _dead_pid(), os.getpid(), _dead_pid()
    names = {
        f"tandem-weights-{dead}-ab12cd34-slot": False,  # removed
        f"tandem-samples-{dead}-ef56ab78-g3": False,
        f"tandem-weights-{alive}-0badc0de-slot": True,  # kept: its process still runs
        f"tandem-samples-{unrecorded}-12345678-g1": True,  # kept: not this run's
        f"tandem-weights-9{dead}-12345678-slot": True,  # kept: another pid that merely contains it
        f"other-{dead}-file": True,  # kept: not tandem's
    }
    for name in names:
        (shm / name).write_bytes(b"x")
    record_processes(run, [dead, alive], [str(shm)])
    assert remove_leftovers(run) == 2
    assert {p.name for p in shm.iterdir()} == {name for name, kept in names.items() if kept}

    record = json.loads((run / RECORD).read_text())
    (shm / f"tandem-weights-{dead}-ab12cd34-slot").write_bytes(b"x")
    another_boot = [{**p, "boot_id": "another boot"} for p in record["processes"]]
    (run / RECORD).write_text(json.dumps({**record, "processes": another_boot}))  # pids of another boot
    assert remove_leftovers(run) == 0
    assert remove_leftovers(tmp_path / "never_ran") == 0


def _shared_memory_files(pids):
    return [name for name in os.listdir("/dev/shm") if any(f"-{pid}-" in name for pid in pids)]


def _wait_for(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_run_after_kill_9_removes_the_files_the_killed_run_left(rl_files, tmp_path):
    """A fully async trainer killed mid-run leaves its weight slot in /dev/shm; the next run in
    the same output directory removes it before it starts, and trains."""
    output = tmp_path / "run"
    overrides = [
        f"model_path={rl_files['model']}", f"data.train_path={rl_files['train']}", "data.val_path=",
        "data.train_batch_size=4", "data.max_prompt_length=64", "rollout.n=4", "rollout.max_response_length=6",
        "trainer.total_steps=1000", "trainer.loggers=[jsonl]", "trainer.export_hf=false",
        f"reward.custom_path={rl_files['reward']}", f"trainer.output_dir={output}",
        "pipeline.mode=fully_async", "pipeline.trainer_threads=1", "pipeline.rollout_threads=1",
    ]  # fmt: skip
    trainer = subprocess.Popen(
        [sys.executable, "-m", "tandem", "train", *overrides],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for(lambda: (output / RECORD).exists() and _shared_memory_files([trainer.pid]), 180, "the run")
        pids = [p["pid"] for p in json.loads((output / RECORD).read_text())["processes"]]
        assert trainer.pid in pids and len(pids) >= 2  # the trainer and its rollout replica
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        _wait_for(lambda: all(pid_unused(pid) for pid in pids), 60, "the replica to exit")
        left = _shared_memory_files(pids)
        assert left, "the killed trainer left no file to clean (the test would prove nothing)"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(trainer.pid, signal.SIGKILL)  # whatever of the run is still there
    config = small_config(
        rl_files, output, "trainer.total_steps=1", "data.val_path=", "pipeline.mode=fully_async",
        "pipeline.trainer_threads=1", "pipeline.rollout_threads=1",
    )  # fmt: skip
    assert [h["step"] for h in RLTrainer(config).fit().history] == [1]
    assert not _shared_memory_files(pids)
