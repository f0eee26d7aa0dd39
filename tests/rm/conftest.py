"""Synthetic preferences a tiny reward model can learn: of two answers mixing digits and
letters, the one with more digits is preferred."""

import json
import random
import string

import pytest

from tandem.models import save_tiny_model


def mixed_answer(rng: random.Random, length: int, digits: int) -> str:
    chars = [rng.choice(string.digits) for _ in range(digits)]
    chars += [rng.choice(string.ascii_letters) for _ in range(length - digits)]
    rng.shuffle(chars)
    return "".join(chars)


def digit_pairs(count: int, seed: int) -> list[dict]:
    """Arithmetic prompts; two answers of one length, the chosen one with more digits."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b, length = rng.randint(0, 49), rng.randint(0, 49), rng.randint(2, 8)
        fewer = rng.randint(0, length - 1)
        more = rng.randint(fewer + 1, length)
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "chosen": mixed_answer(rng, length, more),
                "rejected": mixed_answer(rng, length, fewer),
            }
        )
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="session")
def rm_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    return {
        "model": str(save_tiny_model(root / "model")),
        "train": write_jsonl(root / "train.jsonl", digit_pairs(256, seed=0)),
        "val": write_jsonl(root / "val.jsonl", digit_pairs(64, seed=1)),
    }
