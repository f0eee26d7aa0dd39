"""Seconds per step of DPO, KTO and ORPO: tandem's trainer vs TRL's DPOTrainer, KTOTrainer and
ORPOTrainer (``trl.experimental.orpo``) on the same model, data and settings, one comparison each.

Both: ``--model tiny`` (default; the benchmark's ~3M-parameter Qwen2, hidden 256, 4 layers, and
character tokenizer) or ``--model smollm2`` (SmolLM2-135M-Instruct, bench/real_model.py), fp32
on CPU, 16 pairs per optimizer step, at most 512 tokens per row, the sigmoid loss with beta 0.1,
and a reference model scoring each step's pairs (TRL's default; tandem's ``reference=model``).
TRL runs with its defaults otherwise (padded batches) and ``use_cpu=True, bf16=False,
gradient_checkpointing=False``; ``--trl-python`` names the interpreter of a separate environment holding TRL.
``--lengths varied`` (default) draws prompt and response lengths as real data varies;
``uniform`` makes every prompt and response the same length, so padding costs TRL nothing and
only tandem's shared prompt copy differs.

KTO trains on the pairs' responses as unpaired rows (chosen desirable, rejected not: 16 rows
per step), with a reference model and TRL's mismatched-completion KL estimate on both sides.
ORPO trains on the pairs with beta 0.1 and no reference model on either side.

Each side runs in a fresh process of its own for ``--rounds`` rounds that alternate which side
goes first; ``--warmup`` untimed steps, then ``--steps`` timed ones; medians and their ratio
are printed (bench/side_by_side.py). TRL is optional: without it only tandem's numbers print.

    python bench/dpo_step.py [--model tiny|smollm2] [--steps 8] [--warmup 2] [--rounds 3]
        [--lengths varied|uniform] [--objectives dpo,kto,orpo] [--trl-python /work/trl-venv/bin/python]
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import BENCH_MODEL  # noqa: E402
from machine import describe_machine  # noqa: E402
from real_model import MODELS, link_model  # noqa: E402
from side_by_side import (  # noqa: E402
    TRL_CPU_ARGS,
    baseline_versions,
    compare,
    run_child,
    side_parser,
    step_timer,
)

from tandem.config.overrides import config_from_overrides  # noqa: E402
from tandem.dpo import DPOConfig, preference_trainer  # noqa: E402
from tandem.models import load_model, load_tokenizer, save_tiny_model  # noqa: E402

PAIRS, LR, BETA = 16, 1e-5, 0.1
OBJECTIVES = ("dpo", "kto", "orpo")
TRL_NAMES = {"dpo": "TRL DPOTrainer", "kto": "TRL KTOTrainer", "orpo": "TRL ORPOTrainer"}


FILLER = "Please explain each step of the addition carefully and check the result at the end. "


def _text(head: str, length: int) -> str:
    """``head`` continued with filler sentences to exactly ``length`` characters."""
    return (head + FILLER * (length // len(FILLER) + 1))[:length]


def pairs(count: int, varied: bool, seed: int = 0) -> list[dict]:
    """Arithmetic prompts with a worked answer preferred to the same working off by one.

    ``varied``: prompt lengths drawn from 32-256 characters and each pair's response length
    from 16-256 (as real preference data varies); otherwise every prompt is 40 characters and
    every response 96 (no padding to gain from)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        prompt_length, response_length = (rng.randint(32, 256), rng.randint(16, 256)) if varied else (40, 96)
        working = f" = {a} plus {b}: add the units, then the tens, then the hundreds. "  # the answer first
        chosen, rejected = (
            _text(f"{a + b}{working}", response_length),
            _text(f"{a + b + 1}{working}", response_length),
        )
        rows.append(
            {
                "prompt": [{"role": "user", "content": _text(f"What is {a} + {b}? ", prompt_length)}],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return rows


def unpaired(rows: list[dict]) -> list[dict]:
    """The pairs as unpaired rows in pair order (chosen desirable, rejected not), for KTO."""
    return [
        {"prompt": row["prompt"], "completion": row[key], "label": key == "chosen"}
        for row in rows
        for key in ("chosen", "rejected")
    ]


def time_tandem(root: Path, steps: int, warmup: int) -> dict[str, list[float]]:
    """``root``: the objective's directory (its name) beside the shared ``model``."""
    objective = root.name
    loss = {"dpo": ["reference=model"], "kto": ["reference=model", "preference.name=kto"]}
    config = config_from_overrides(
        DPOConfig,
        [
            f"model_path={root.parent / 'model'}",
            f"data.train_path={root / 'data.jsonl'}",
            "data.max_length=512",
            *loss.get(objective, ["preference.name=orpo"]),
            f"preference.beta={BETA}",
            f"engine.lr={LR}",
            f"trainer.global_batch_size={PAIRS}",
            f"trainer.total_steps={warmup + steps}",
            "trainer.log_every=1000",
            "trainer.report=false",
            f"trainer.output_dir={root / 'tandem'}",
        ],
    )
    history = preference_trainer(config).fit().history[warmup:]
    return {"step": [h["timing_s/step"] for h in history]}


def trl_classes(objective: str) -> tuple[type, type]:
    """TRL's config and trainer for ``objective``; ImportError when not installed."""
    if objective == "dpo":
        from trl import DPOConfig as TRLConfig
        from trl import DPOTrainer as TRLTrainer
    elif objective == "kto":
        from trl import KTOConfig as TRLConfig
        from trl import KTOTrainer as TRLTrainer
    else:
        from trl.experimental.orpo import ORPOConfig as TRLConfig
        from trl.experimental.orpo import ORPOTrainer as TRLTrainer
    return TRLConfig, TRLTrainer


def time_trl(root: Path, steps: int, warmup: int) -> list[float] | None:
    try:
        from datasets import Dataset

        TRLConfig, TRLTrainer = trl_classes(root.name)
    except ImportError:
        return None
    rows = [json.loads(line) for line in (root / "data.jsonl").read_text().splitlines()]
    args = TRLConfig(
        output_dir=str(root / "trl"),
        per_device_train_batch_size=PAIRS,
        learning_rate=LR,
        beta=BETA,
        max_length=512,
        max_steps=warmup + steps,
        **TRL_CPU_ARGS,
    )
    timer = step_timer()
    trainer = TRLTrainer(
        model=load_model(root.parent / "model"),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=load_tokenizer(root.parent / "model"),
        callbacks=[timer],
    )
    trainer.train()
    return timer.times[warmup:]


def child(side: str, root: Path, steps: int, warmup: int) -> None:
    run_child(side, lambda: time_tandem(root, steps, warmup), lambda: time_trl(root, steps, warmup))


def main() -> None:
    parser = side_parser(__doc__)
    parser.add_argument("--model", choices=MODELS, default="tiny")
    parser.add_argument(
        "--lengths",
        choices=["varied", "uniform"],
        default="varied",
        help="prompt and response lengths (see pairs())",
    )
    parser.add_argument("--objectives", default=",".join(OBJECTIVES), help="which of dpo,kto,orpo to compare")
    args = parser.parse_args()
    if args.side:
        child(args.side, args.root, args.steps, args.warmup)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = link_model(root) if args.model == "smollm2" else save_tiny_model(root / "model", BENCH_MODEL)
        count = PAIRS * (args.steps + args.warmup)
        rows = pairs(count, varied=args.lengths == "varied")
        params = sum(p.numel() for p in load_model(model).parameters())
        print(describe_machine())
        print(baseline_versions(args.trl_python))
        print(
            f"model: {args.model}, {params / 1e6:.2f}M parameters, fp32; {PAIRS} pairs (rows) per step, {args.lengths} lengths"
        )
        for objective in args.objectives.split(","):
            if objective not in OBJECTIVES:
                raise SystemExit(f"--objectives: {objective!r} is not one of {list(OBJECTIVES)}")
            (root / objective).mkdir()
            data = unpaired(rows) if objective == "kto" else rows
            (root / objective / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
            print(f"--- {objective.upper()}")
            compare(
                __file__,
                root / objective,
                args.rounds,
                args.steps,
                args.warmup,
                TRL_NAMES[objective],
                f"{objective.upper()} step",
                args.trl_python,
            )


if __name__ == "__main__":
    main()
