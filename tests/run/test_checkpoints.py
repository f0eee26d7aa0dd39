"""Checkpoints: a damaged one (truncated or missing file, unreadable state) is named and skipped for
the newest intact one, or refused when asked for by path; a save on a full disk keeps the earlier
ones, leaves no ``.tmp`` and marks the run failed in ``status.json``. The disk is a real tmpfs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from rich.console import Console

from tandem.errors import CheckpointSaveError
from tandem.files import atomic_directory
from tandem.report.run_info import RunInfo
from tandem.run.checkpoints import MANIFEST, CheckpointManager
from tandem.run.loop import Schedule, recording, run_steps
from tests.run.conftest import fill


def engines_of(size: int):
    """``save_engines`` writing one tensor shard of ``size`` floats and a small file, as an engine does."""

    def save(directory: Path) -> None:
        (directory / "engine").mkdir()
        torch.save(torch.arange(size, dtype=torch.float32), directory / "engine" / "shard.pt")
        (directory / "engine" / "extra.json").write_text("{}")

    return save


def saved_at(root: Path, steps: list[int], size: int = 64) -> CheckpointManager:
    manager = CheckpointManager(root, keep_last=0)
    for step in steps:
        manager.save(step, {"step": step, "sampler": {"epoch": 0}}, engines_of(size))
    return manager


def test_the_manifest_lists_every_file_with_its_size(tmp_path):
    manager = saved_at(tmp_path, [2])
    path = manager.latest()
    manifest = json.loads((path / MANIFEST).read_text())["files"]
    on_disk = {
        str(f.relative_to(path)): f.stat().st_size
        for f in path.rglob("*")
        if f.is_file() and f.name != MANIFEST
    }
    assert manifest == on_disk and "engine/shard.pt" in manifest
    assert CheckpointManager.problem(path) is None


@pytest.mark.parametrize("damage", ["truncated", "missing", "state"])
def test_a_damaged_checkpoint_is_named_and_skipped_for_the_newest_intact_one(tmp_path, damage):
    manager = saved_at(tmp_path, [2, 4])
    broken = tmp_path / "global_step_4"
    shard = broken / "engine" / "shard.pt"
    if damage == "truncated":
        os.truncate(shard, shard.stat().st_size // 2)
        named = f"{shard} holds {shard.stat().st_size} bytes where"
    elif damage == "missing":
        shard.unlink()
        named = f"{shard} is missing"
    else:
        (broken / "trainer_state.json").write_text('{"step": 4, "samp')  # cut mid-write, of another size
        named = str(broken / "trainer_state.json")
    warnings: list[str] = []
    assert manager.resume_point(warnings.append) == tmp_path / "global_step_2"
    assert len(warnings) == 1 and str(broken) in warnings[0] and named in warnings[0], warnings
    with pytest.raises(ValueError, match=f"cannot resume from checkpoint {broken}: ") as error:
        CheckpointManager.check_intact(broken)
    assert named in str(error.value)
    assert CheckpointManager.check_intact(tmp_path / "global_step_2") == tmp_path / "global_step_2"


def test_a_corrupt_trainer_state_is_an_error_naming_the_file(tmp_path):
    path = saved_at(tmp_path, [2]).latest()
    (path / MANIFEST).unlink()  # as a checkpoint written before manifests: the state file is still checked
    state = path / "trainer_state.json"
    state.write_text("\x00" * len(state.read_text()))  # same size: only reading it finds the damage
    with pytest.raises(ValueError, match=f"{state} is not valid JSON .*; the checkpoint is damaged"):
        CheckpointManager.read_state(path)
    assert CheckpointManager(tmp_path, 0).resume_point(lambda message: None) is None


def test_a_full_disk_keeps_the_earlier_checkpoint_and_leaves_no_tmp(small_disk):
    manager = saved_at(small_disk / "checkpoints", [2], size=16)
    fill(small_disk, leave=64 * 1024)
    with pytest.raises(CheckpointSaveError) as error:
        manager.save(4, {"step": 4}, engines_of(256 * 1024))  # a 1 MiB shard in 64 KiB
    message = str(error.value)
    assert message.startswith("checkpoint of step 4 not saved: no space left on the device of ")
    assert f"{small_disk / 'checkpoints' / 'global_step_2'} and the earlier checkpoints are intact" in message
    assert sorted(p.name for p in (small_disk / "checkpoints").iterdir()) == ["global_step_2", "latest"]
    assert manager.resume_point(lambda message: None) == small_disk / "checkpoints" / "global_step_2"


class SavesBig:
    """A trainer of the run loop whose step 2 checkpoint does not fit on the disk."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.step, self.manager = 0, manager

    def train_step(self) -> dict[str, float]:
        self.step += 1
        return {"loss": 1.0 / self.step}

    def validate(self) -> dict[str, float]:
        return {}

    def save_checkpoint(self) -> Path:
        return self.manager.save(
            self.step, {"step": self.step}, engines_of(16 if self.step == 1 else 256 * 1024)
        )


def test_a_full_disk_during_a_run_marks_it_failed_with_one_message_and_no_temp_files(small_disk):
    out = small_disk / "run"
    info = RunInfo(out, "test", "e", "p", {}, "model", {}, total_steps=3)
    trainer = SavesBig(CheckpointManager(out / "checkpoints", keep_last=0))
    schedule = Schedule(total_steps=3, validate_every=0, save_every=1, validates=False)
    failing = pytest.raises(CheckpointSaveError, match="checkpoint of step 2 not saved")
    with failing, recording(info, [], 0, Console(quiet=True)) as record:
        fill(small_disk, leave=96 * 1024)  # after run.json and status.json are written
        run_steps(trainer, schedule, record)
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "failed" and status["step"] == 2
    assert status["error"].startswith("CheckpointSaveError: checkpoint of step 2 not saved")
    assert [p.relative_to(out).as_posix() for p in out.rglob("*.tmp")] == []
    assert [h["step"] for h in record.history] == [1, 2]


def test_an_export_on_a_full_disk_keeps_the_previous_directory_and_leaves_no_tmp(small_disk):
    target = small_disk / "hf_model"
    with atomic_directory(target) as staging:
        (staging / "weights").write_text("v1")
    with pytest.raises(OSError, match="No space left on device"), atomic_directory(target) as staging:
        (staging / "weights").write_bytes(b"\0" * (2 << 20))  # 2 MiB on a 1 MiB disk
    assert sorted(p.name for p in small_disk.iterdir()) == ["hf_model"]
    assert (target / "weights").read_text() == "v1"
