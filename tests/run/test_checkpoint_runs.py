"""Whole SFT runs over damaged checkpoints and a full disk (slow: several runs each; the fast
siblings drive :class:`CheckpointManager` and the run loop directly in test_checkpoints.py).

A run saves at steps 2 and 4; step 4's shard is truncated; resuming continues from step 2, says
so naming the damaged checkpoint, and equals the uninterrupted run. A save on a full (real tmpfs)
disk fails with one line, marks the run failed, leaves no temporary file, and the run resumes
exactly once there is space again."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch
from rich.console import Console

from tandem.cli import main
from tandem.models import load_model, save_tiny_model
from tandem.sft import SFTConfig, SFTDataConfig, SFTTrainer, SFTTrainerConfig
from tests.run.conftest import fill, mounted_tmpfs
from tests.sft.test_sft import addition_conversations, write_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoint_runs")
    return {
        "model": str(save_tiny_model(root / "model")),
        "train": write_jsonl(root / "train.jsonl", addition_conversations(24, 2)),
        "full": root / "full",
    }


def settings(files, out, steps: int) -> list[str]:
    return [
        f"model_path={files['model']}",
        f"data.train_path={files['train']}",
        "trainer.global_batch_size=5",
        f"trainer.total_steps={steps}",
        "trainer.save_every=2",
        f"trainer.output_dir={out}",
        "trainer.resume=true",
    ]


def sft(files, out, steps: int, console: Console | None = None):
    config = SFTConfig(
        model_path=files["model"],
        data=SFTDataConfig(train_path=files["train"]),
        trainer=SFTTrainerConfig(
            global_batch_size=5, total_steps=steps, save_every=2, output_dir=str(out), resume=True
        ),
    )
    return SFTTrainer(config, console).fit()


@pytest.fixture(scope="module")
def uninterrupted(files):
    return sft(files, files["full"], 6)


def assert_same_models(a_dir, b_dir):
    a, b = load_model(a_dir).state_dict(), load_model(b_dir).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_truncated_shard_falls_back_to_the_previous_checkpoint_and_resumes_exactly(
    files, uninterrupted, tmp_path
):
    out = tmp_path / "run"
    sft(files, out, 4)  # saves at steps 2 and 4
    shards = sorted((out / "checkpoints" / "global_step_4" / "engine" / "dcp").glob("*.distcp"))
    os.truncate(shards[0], shards[0].stat().st_size // 2)
    said = io.StringIO()
    resumed = sft(files, out, 6, Console(file=said, width=400))
    assert (
        f"warning: checkpoint {out / 'checkpoints' / 'global_step_4'} is damaged ({shards[0]} holds"
        in said.getvalue()
    )
    assert f"resumed from {out / 'checkpoints' / 'global_step_2'}" in said.getvalue()
    assert resumed.train_losses == uninterrupted.train_losses[2:]
    assert_same_models(uninterrupted.hf_model_dir, resumed.hf_model_dir)


def test_a_full_disk_during_a_save_is_one_line_a_failed_run_and_an_exact_resume(
    files, uninterrupted, tmp_path, capsys
):
    with mounted_tmpfs(tmp_path / "disk", "64m") as disk:
        out = disk / "run"
        assert main(["sft", *settings(files, out, 2)]) == 0
        fill(disk, leave=256 * 1024)  # room for the steps' records, not for a checkpoint
        capsys.readouterr()
        assert main(["sft", *settings(files, out, 4)]) == 2
        errors = capsys.readouterr().err.strip().splitlines()
        error = [line for line in errors if line.startswith("tandem sft: error:")]
        assert len(error) == 1 and error[0].startswith(
            "tandem sft: error: checkpoint of step 4 not saved: no space left"
        )
        assert all(line == error[0] or "could not close" in line for line in errors), errors  # no traceback
        status = json.loads((out / "status.json").read_text())
        assert (
            status["status"] == "failed" and status["step"] == 4 and "CheckpointSaveError" in status["error"]
        )
        assert [p for p in out.rglob("*") if p.name.endswith(".tmp")] == []
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["global_step_2", "latest"]
        (disk / "filler").unlink()
        assert main(["sft", *settings(files, out, 6)]) == 0
        logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [entry["loss"] for entry in logged if entry["step"] > 2] == uninterrupted.train_losses[2:]
        assert_same_models(uninterrupted.hf_model_dir, out / "hf_model")
