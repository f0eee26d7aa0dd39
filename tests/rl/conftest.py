"""A tiny model and arithmetic prompts shared by the RL tests, and a helper that builds small configs."""

import pytest

from tandem.models import save_tiny_model
from tandem.rl import load_train_config
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows, write_parquet


@pytest.fixture(scope="session")
def rl_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    task = ArithmeticTaskConfig(max_digits=2)
    reward = root / "digit_share.py"
    reward.write_text(  # a random tiny model never solves arithmetic: reward something it does by chance
        "def compute_score(data_source, solution, ground_truth, extra_info):\n"
        "    return sum(c.isdigit() for c in solution) / max(len(solution), 1)\n"
    )
    return {
        "reward": str(reward),
        "model": str(save_tiny_model(root / "model")),
        "train": str(write_parquet(arithmetic_rows(64, task, seed=0), root / "train.parquet")),
        "val": str(write_parquet(arithmetic_rows(12, task, seed=1, split="test"), root / "val.parquet")),
    }


def small_config(files, output_dir, *overrides):
    """A fast GRPO config: 4 prompts x 4 responses, 6 new tokens, rewarding the share of digits."""
    return load_train_config(
        [
            f"model_path={files['model']}",
            f"data.train_path={files['train']}",
            f"data.val_path={files['val']}",
            "data.train_batch_size=4",
            "data.max_prompt_length=64",
            "rollout.n=4",
            "rollout.max_response_length=6",
            "actor.engine.lr=1e-3",
            "trainer.total_steps=2",
            "trainer.loggers=[jsonl]",
            "trainer.export_hf=false",
            f"reward.custom_path={files['reward']}",
            f"trainer.output_dir={output_dir}",
            *overrides,
        ]
    )
