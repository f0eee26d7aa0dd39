"""The DPO demo: the main demo's flawed-teacher warm-up, then DPO on pairs that prefer the right
sum to the teacher's slip (one too high), and held-out greedy accuracy before and after.

It shares the main demo's model, task and SFT warm-up (:mod:`tandem.demos.arithmetic`): the warmed-up
model answers one too high most of the time. The preference pairs are built from the SFT
problems (never from the validation ones): chosen = the right sum, rejected = the sum plus one.
Offline DPO only sees those fixed pairs — no sampling, no reward function at training time.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table
from transformers.utils import logging as hf_logging

from tandem.config.overrides import config_from_overrides
from tandem.config.validation import check_positive, check_range
from tandem.demos.arithmetic import MODEL, DemoSettings, warm_up, write_demo_data
from tandem.demos.settings import check_count
from tandem.dpo.config import DPOConfig
from tandem.dpo.trainer import DPOResult, DPOTrainer
from tandem.models import save_tiny_model
from tandem.models.chat import template_ids
from tandem.models.loading import load_tokenizer
from tandem.rl.rewards.scorers import arithmetic_score
from tandem.rollout import RolloutRequest, SamplingParams
from tandem.rollout.config import RolloutEngineConfig
from tandem.rollout.factory import build_rollout_engine


@dataclass(frozen=True)
class DPODemoSettings:
    """Sizes of the DPO demo (the defaults are what the README's numbers were measured with).

    ``warm_up``: the main demo's settings for the shared warm-up (output directory included).
    ``sft_model_dir``: start from this finished warm-up instead of running it.
    ``pairs``: right-vs-slip pairs written; ``steps`` of ``pairs_per_step`` pairs at ``lr``.
    ``beta``, ``loss``, ``rpo_alpha``: the DPO run's ``preference.*`` (``loss`` is checked there).
    """

    warm_up: DemoSettings = DemoSettings()
    sft_model_dir: str = ""
    pairs: int = 4096
    steps: int = 60
    pairs_per_step: int = 64
    lr: float = 5e-4
    beta: float = 0.1
    loss: str = "sigmoid"
    rpo_alpha: float = 1.0

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("pairs", "steps", "pairs_per_step"):
            check_count(owner, name, getattr(self, name))
        check_positive(owner, "lr", self.lr)
        check_positive(owner, "beta", self.beta)
        check_range(owner, "rpo_alpha", self.rpo_alpha, low=0.0)


def greedy_accuracy(model_dir: str | Path, rows: list[dict]) -> float:
    """Exact-match accuracy of greedy answers to verl-schema arithmetic ``rows``, with the native engine."""
    tokenizer = load_tokenizer(str(model_dir))
    engine = build_rollout_engine(RolloutEngineConfig(), str(model_dir))
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=8)
        completions = engine.generate_batch(
            RolloutRequest(str(i), tuple(template_ids(tokenizer, list(row["prompt"]), True)), greedy)
            for i, row in enumerate(rows)
        )
    finally:
        engine.close()
    scores = [
        arithmetic_score(
            tokenizer.decode(completion.token_ids, skip_special_tokens=True),
            str(row["reward_model"]["ground_truth"]),
            row.get("extra_info") or {},
        )["acc"]
        for completion, row in zip(completions, rows, strict=True)
    ]
    return sum(scores) / len(scores)


def write_slip_pairs(sft_path: Path, target: Path, count: int) -> Path:
    """Pairs from the first ``count`` SFT problems (``a+b=``): the right sum over the teacher's slip (+1)."""
    with sft_path.open() as source, target.open("w") as out:
        for _, line in zip(range(count), source, strict=False):
            prompt = json.loads(line)["messages"][:-1]
            right = sum(int(term) for term in prompt[-1]["content"].rstrip("=").split("+"))
            out.write(json.dumps({"prompt": prompt, "chosen": str(right), "rejected": str(right + 1)}) + "\n")
    return target


def run_dpo_demo(settings: DPODemoSettings | None = None, console: Console | None = None) -> DPOResult:
    """Warm up (or reuse a warm-up), train with DPO, and print held-out accuracy before and after."""
    settings = settings or DPODemoSettings()
    console = console or Console()
    hf_logging.disable_progress_bar()
    root = Path(settings.warm_up.output_dir)
    started = time.monotonic()
    console.rule("tandem demo: 2-digit addition, SFT on a flawed teacher, then DPO on right-vs-slip pairs")
    base = save_tiny_model(root / "base_model", MODEL)
    paths = write_demo_data(root, settings.warm_up)
    sft_model = settings.sft_model_dir or str(warm_up(settings.warm_up, base, paths, root, console))
    pairs = write_slip_pairs(paths["sft"], root / "data" / "dpo_pairs.jsonl", settings.pairs)
    val_rows = pq.read_table(paths["val"]).to_pylist()
    before = greedy_accuracy(sft_model, val_rows)
    console.rule(f"2. DPO ({settings.steps} steps of {settings.pairs_per_step} pairs, {settings.loss} loss)")
    config = config_from_overrides(
        DPOConfig,
        [
            f"model_path={sft_model}",
            f"data.train_path={pairs}",
            "data.max_length=64",
            f"preference.name={settings.loss}",
            f"preference.beta={settings.beta}",
            f"preference.rpo_alpha={settings.rpo_alpha}",
            f"engine.lr={settings.lr}",
            f"engine.seed={settings.warm_up.seed}",
            f"trainer.global_batch_size={settings.pairs_per_step}",
            f"trainer.total_steps={settings.steps}",
            "trainer.log_every=10",
            f"trainer.seed={settings.warm_up.seed}",
            f"trainer.output_dir={root / 'dpo'}",
            "trainer.experiment=demo-dpo-arithmetic",
        ],
    )
    result = DPOTrainer(config, console).fit()
    after = greedy_accuracy(result.hf_model_dir, val_rows)
    table = Table(title=f"held-out greedy accuracy ({len(val_rows)} unseen problems)", title_justify="left")
    table.add_column("stage")
    table.add_column("accuracy", justify="right")
    table.add_row("after SFT warm-up", f"{before:.1%}")
    table.add_row(f"after DPO ({settings.steps} steps)", f"[bold]{after:.1%}")
    console.print(table)
    console.print(
        f"total time {time.monotonic() - started:.0f} s; report: {result.report}; final model: {result.hf_model_dir}"
    )
    return result
