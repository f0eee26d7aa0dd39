"""Launch scripts of verl 0.8/0.9 (tests/verl/release_scripts.py) translate key by key: bash
builds the launch line, ``tests.verl.echo_args`` hands it back, and the translation must equal
the tandem settings written out here. The CISPO script (gsm8k + MATH, two files) also trains."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tandem.data import write_parquet
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows
from tandem.verl import translate
from tests.verl import release_scripts
from tests.verl.test_keys import _settings
from tests.verl.test_scripts import NATIVE, run_script

ROOT = Path(__file__).parents[2]


def launch_items(text: str, env: dict[str, str], *args: str) -> list[str]:
    """The ``key=value`` items the script passes to verl's trainer."""
    done = subprocess.run(
        ["bash", "-c", text, "script", *args],
        env={**os.environ, **env, "LAUNCH": "tests.verl.echo_args", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


FILES = {
    "MODEL_PATH": "/models/qwen",
    "TRAIN_FILE": "/data/dapo.parquet",
    "TEST_FILE": "/data/aime.parquet",
    "GSM8K_TRAIN": "/data/gsm8k/train.parquet",
    "GSM8K_TEST": "/data/gsm8k/test.parquet",
    "MATH_TRAIN": "/data/math/train.parquet",
    "MATH_TEST": "/data/math/test.parquet",
}


def test_the_cispo_script_reads_both_training_files():
    items = launch_items(release_scripts.CISPO_GSM8K_MATH, FILES, "trainer.device=cpu")
    settings = _settings(translate(items))
    assert settings["data.train_path"] == "[/data/gsm8k/train.parquet,/data/math/train.parquet]"
    assert settings["data.val_path"] == "[/data/gsm8k/test.parquet,/data/math/test.parquet]"
    assert settings["actor.policy_loss.name"] == "cispo"
    assert settings["actor.policy_loss.clip_ratio_low"] == "1.0"  # verl's 10: no lower bound either way


def test_the_megatron_moe_script_is_refused_naming_its_engine():
    """The script runs on Megatron-LM (model_engine=megatron); tandem has no stand-in for its
    parallelism, so the command is refused rather than run as something else."""
    items = launch_items(release_scripts.MOE_MEGATRON, FILES, "trainer.device=cpu")
    assert "model_engine=megatron" in items
    with pytest.raises(ValueError, match="model_engine=megatron: tandem has no Megatron-LM engine"):
        translate(items)
    # without the engine choice its other keys translate, the Megatron ones noted
    translation = translate([item for item in items if item != "model_engine=megatron"])
    settings = _settings(translation)
    expected = {
        "reward.overlong.enable": "true",  # read at verl's older place
        "reward.overlong.buffer": "4",
        "reward.overlong.penalty_factor": "1.0",
        "data.overlong_prompts": "truncate_left",
        "actor.engine.max_tokens_per_micro_batch": "3000",
    }
    assert {key: settings[key] for key in expected} == expected
    noted = {note.split(":")[0] for note in translation.notes}
    assert {
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
        "actor_rollout_ref.ref.megatron.use_mbridge",
        "actor_rollout_ref.rollout.moe_tensor_parallel_size",
    } <= noted
    translation.config()


def test_the_cispo_script_trains_on_two_files(rl_files, tmp_path):
    """Two files with their own data sources: the run reads both and validates per source."""
    task = ArithmeticTaskConfig(max_digits=2)
    files = {}
    for split, count, seed in (("train", 16, 0), ("test", 4, 1)):
        for source in ("gsm8k", "math"):
            rows = arithmetic_rows(count, task, seed=seed + (source == "math") * 10, split=split)
            for row in rows:
                row["data_source"] = f"{source}_like"
            key = f"{source.upper()}_{split.upper()}"
            files[key] = str(write_parquet(rows, tmp_path / source / f"{split}.parquet"))
    out = tmp_path / "cispo"
    done = run_script(
        release_scripts.CISPO_GSM8K_MATH,
        rl_files,
        "trainer.total_training_steps=1",
        "trainer.val_before_train=False",
        "trainer.test_freq=1",
        f"trainer.default_local_dir={out}",
        "trainer.logger=[console]",
        f"custom_reward_function.path={rl_files['reward']}",
        *NATIVE,
        env=files,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validation = {key for line in lines for key in line if key.startswith("val-core/")}
    assert any("gsm8k_like" in key for key in validation) and any("math_like" in key for key in validation)
