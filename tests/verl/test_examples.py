"""examples/: each recipe written the verl way and the tandem way resolves to the same config,
and the tandem way trains (two steps, sizes shrunk by appended keys)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"


def run_example(script: Path, files: dict, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "MODEL_PATH": files["model"],
        "TRAIN_FILE": files["train"],
        "TEST_FILE": files["val"],
    }
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=600)


def resolved_config(output: str) -> str:
    return output.split("# the resolved config:\n", 1)[1]


@pytest.mark.parametrize(  # one recipe in the default tier, the others in the slow one
    "recipe", ["grpo_gsm8k", pytest.param("dapo_math", marks=pytest.mark.slow), pytest.param("ppo_gsm8k", marks=pytest.mark.slow)]
)
def test_verl_way_and_tandem_way_are_the_same_run(recipe):
    files = {"model": "/models/qwen", "train": "/data/train.parquet", "val": "/data/test.parquet"}
    verl = run_example(EXAMPLES / recipe / "verl.sh", files, "--print-config")
    tandem = run_example(EXAMPLES / recipe / "tandem.sh", files, "--print-config")
    assert verl.returncode == 0, verl.stderr
    assert tandem.returncode == 0, tandem.stderr
    assert resolved_config(tandem.stdout) == resolved_config(verl.stdout)


def test_the_tandem_way_trains(rl_files, tmp_path):
    done = run_example(
        EXAMPLES / "grpo_gsm8k" / "tandem.sh",
        rl_files,
        "data.train_batch_size=4",
        "data.max_prompt_length=64",
        "rollout.max_response_length=6",
        "rollout.n=2",
        "rollout.engine.name=native",
        "actor.ppo_mini_batch_size=4",
        "actor.engine.max_tokens_per_micro_batch=1024",
        "trainer.total_steps=2",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={tmp_path}",
        f"reward.custom_path={rl_files['reward']}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = {json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()}
    assert {1, 2} <= steps
