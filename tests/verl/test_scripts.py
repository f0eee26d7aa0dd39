"""verl's launch scripts run on tandem with one word changed (``verl.trainer.main_ppo`` ->
``tandem.verl.main_ppo``): GRPO on gsm8k-style data and DAPO train two steps on the CPU; the
PPO quick start trains with its critic; ``--print-config``
output is stable (a golden file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.verl import scripts

GOLDEN = Path(__file__).parent / "golden"
NATIVE = ["--set", "rollout.engine.name=native"]  # the scripts ask for vLLM; this machine has none


def run_script(
    text: str, files: dict, *args: str, output_dir: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run a verl script on tandem; ``env`` adds the variables a script reads beyond the usual files."""
    env = {
        **os.environ,
        **(env or {}),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # python3 is this interpreter
        "LAUNCH": "tandem.verl.main_ppo",
        "TRAIN_FILE": files["train"],
        "TEST_FILE": files["val"],
        "MODEL_PATH": files["model"],
        "CKPTS_DIR": str(output_dir or "/tmp/unused"),
    }
    return subprocess.run(
        ["bash", "-c", text, "script", *args], env=env, capture_output=True, text=True, timeout=600
    )


def _run_json(output_dir: Path) -> dict:
    return json.loads((output_dir / "run.json").read_text())["config"]


def _steps(output_dir: Path) -> list[int]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return sorted({json.loads(line)["step"] for line in lines if '"actor/' in line})


def test_grpo_gsm8k_script_trains(rl_files, tmp_path):
    out = tmp_path / "grpo"
    done = run_script(
        scripts.GRPO_GSM8K,
        rl_files,
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={out}",
        f"custom_reward_function.path={rl_files['reward']}",
        *NATIVE,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "note: actor_rollout_ref.rollout.tensor_model_parallel_size" in done.stdout
    assert _steps(out) == [1, 2]
    config = _run_json(out)
    assert config["algorithm"]["kl"] == {**config["algorithm"]["kl"], "use_kl_loss": True, "estimator": "k3"}
    assert config["actor"]["engine"]["max_tokens_per_micro_batch"] == 3000
    assert config["actor"]["ppo_mini_batch_size"] == 2 and config["rollout"]["n"] == 4


def test_dapo_script_trains(rl_files, tmp_path):
    out = tmp_path / "dapo"
    done = run_script(
        scripts.DAPO, rl_files, f"custom_reward_function.path={rl_files['reward']}", *NATIVE, output_dir=out
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _steps(out) == [1, 2]
    config = _run_json(out)
    loss = config["actor"]["policy_loss"]
    assert (loss["clip_ratio_low"], loss["clip_ratio_high"], loss["clip_ratio_c"]) == (0.2, 0.28, 10.0)
    assert config["reward"]["overlong"] == {"enable": True, "buffer": 4, "penalty_factor": 1.0}
    assert config["algorithm"]["filter_groups"] == {"enable": True, "max_num_gen_batches": 3, "metric": "acc"}
    assert config["data"]["overlong_prompts"] == "truncate_left"
    assert (config["rollout"]["val_temperature"], config["rollout"]["val_top_p"]) == (1.0, 0.7)
    assert config["actor"]["engine"]["weight_decay"] == 0.1 and config["actor"]["engine"]["warmup_steps"] == 1
    assert "tensorboard" in config["trainer"]["loggers"]


def test_ppo_quickstart_trains_the_actor_and_a_critic(rl_files, tmp_path):
    out = tmp_path / "ppo"
    done = run_script(
        scripts.PPO_QUICKSTART,
        rl_files,
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={out}",
        "trainer.logger=[console,file]",
        f"custom_reward_function.path={rl_files['reward']}",
        *NATIVE,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _steps(out) == [1, 2]
    config = _run_json(out)
    assert config["algorithm"]["adv_estimator"] == "gae"  # verl's default: PPO with a critic
    assert (config["critic"]["model_path"], config["critic"]["engine"]["lr"]) == (rl_files["model"], 1e-5)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("critic/vf_loss" in line for line in lines if "actor/pg_loss" in line)


@pytest.mark.parametrize("name", ["GRPO_GSM8K", "DAPO"])
def test_print_config_is_stable(name):
    files = {"train": "/data/train.parquet", "val": "/data/test.parquet", "model": "/models/qwen"}
    done = run_script(getattr(scripts, name), files, "trainer.device=cpu", "--print-config")
    assert done.returncode == 0, done.stderr
    golden = GOLDEN / f"{name.lower()}.txt"
    if os.environ.get("TANDEM_UPDATE_GOLDEN"):
        golden.write_text(done.stdout)
    assert done.stdout == golden.read_text(), f"regenerate with TANDEM_UPDATE_GOLDEN=1 pytest {__file__}"
