"""The command line (``tandem prepare-data``, ``tandem train``, ``python -m tandem.train``) and a shrunk demo."""

import subprocess
import sys

from tandem.cli import main
from tandem.demos.accuracy import ACCURACY_KEY
from tandem.demos.arithmetic import DemoSettings, run_demo
from tandem.models import build_char_tokenizer
from tandem.rl.data import RLDataset
from tandem.run.trackers import read_jsonl


def test_prepare_data_refuses_a_format_it_cannot_write_before_doing_work(tmp_path, capsys):
    assert main(["prepare-data", "arithmetic", "--out", str(tmp_path / "x.csv")]) == 2
    assert "--out " in capsys.readouterr().err and not (tmp_path / "x.csv").exists()


def test_prepare_data_then_train_from_the_command_line(rl_files, tmp_path):
    data = tmp_path / "add.parquet"
    assert main(["prepare-data", "arithmetic", "--out", str(data), "--count", "40", "--max-digits", "3"]) == 0
    assert len(RLDataset.load(data, build_char_tokenizer(), 64)) == 40
    as_jsonl = tmp_path / "add.jsonl"  # the same rows as JSON lines, by the name's extension
    assert (
        main(["prepare-data", "arithmetic", "--out", str(as_jsonl), "--count", "40", "--max-digits", "3"])
        == 0
    )
    assert as_jsonl.read_text().startswith("{")
    from_jsonl = RLDataset.load(as_jsonl, build_char_tokenizer(), 64)
    assert from_jsonl.samples == RLDataset.load(data, build_char_tokenizer(), 64).samples
    overrides = [
        "preset=dr_grpo",
        f"model_path={rl_files['model']}",
        f"data.train_path={data}",
        "data.train_batch_size=4",
        "rollout.n=2",
        "rollout.max_response_length=4",
        "trainer.total_steps=1",
        "trainer.export_hf=false",
        f"trainer.output_dir={tmp_path / 'cli'}",
    ]
    assert main(["train", *overrides]) == 0
    assert [r["step"] for r in read_jsonl(tmp_path / "cli" / "metrics.jsonl")] == [1]
    module = subprocess.run(
        [sys.executable, "-m", "tandem.train", *overrides, "trainer.total_steps=2"],
        capture_output=True,
        text=True,
    )
    assert module.returncode == 0, module.stderr[-2000:]
    assert "resumed from" in module.stdout  # resume=auto picks up the step-1 checkpoint
    bad = subprocess.run(
        [sys.executable, "-m", "tandem.train", *overrides, "rollout.n=zero"], capture_output=True, text=True
    )
    assert bad.returncode != 0 and "rollout.n=zero" in bad.stderr


def test_a_shrunk_demo_runs_end_to_end(tmp_path):
    settings = DemoSettings(
        output_dir=str(tmp_path), sft_steps=4, sft_batch_size=8, rl_steps=2, prompts_per_step=4,
        responses_per_prompt=4, mini_batch_prompts=4, val_prompts=8, val_every=1,
    )  # fmt: skip
    result = run_demo(settings)
    curve = [r[ACCURACY_KEY] for r in result.history if ACCURACY_KEY in r]
    assert len(curve) == 3 and all(0.0 <= a <= 1.0 for a in curve)
    assert (tmp_path / "grpo" / "report.html").exists() and (result.hf_model_dir / "config.json").exists()
