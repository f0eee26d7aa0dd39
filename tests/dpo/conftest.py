"""Preference pairs on 2-digit addition (the right sum preferred to a near miss) and a tiny model."""

import json
import random

import pytest

from tandem.config.overrides import config_from_overrides
from tandem.dpo import DPOConfig
from tandem.models import save_tiny_model


def addition_pairs(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        wrong = a + b + rng.choice([-10, -1, 1, 10])
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "chosen": {"role": "assistant", "content": str(a + b)},
                "rejected": str(wrong),
            }
        )
    return rows


def hedged_pairs(count: int, seed: int) -> list[dict]:
    """A preference a tiny model can learn as a rule: the bare sum over the same sum hedged
    with " maybe" (no arithmetic needed, so held-out pairs can be judged right too)."""
    return [{**row, "rejected": f"{row['chosen']['content']} maybe"} for row in addition_pairs(count, seed)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="session")
def dpo_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    return {
        "model": str(save_tiny_model(root / "model")),
        "train": write_jsonl(root / "train.jsonl", addition_pairs(64, seed=0)),
        "val": write_jsonl(root / "val.jsonl", addition_pairs(16, seed=1)),
        "hedged_train": write_jsonl(root / "hedged_train.jsonl", hedged_pairs(64, seed=2)),
        "hedged_val": write_jsonl(root / "hedged_val.jsonl", hedged_pairs(16, seed=3)),
    }


def dpo_config(files, output_dir, *overrides):
    """A fast DPO config: 8 pairs per step, 4 steps, validation at the end."""
    return config_from_overrides(
        DPOConfig,
        [
            f"model_path={files['model']}",
            f"data.train_path={files['train']}",
            f"data.val_path={files['val']}",
            "trainer.global_batch_size=8",
            "trainer.total_steps=4",
            "trainer.log_every=100",
            "engine.lr=1e-3",
            f"trainer.output_dir={output_dir}",
            *overrides,
        ],
    )
