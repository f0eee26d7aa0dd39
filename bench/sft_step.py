"""Seconds per SFT step: tandem's trainer vs TRL's SFTTrainer on the same model, rows and settings.

Both: ``--model tiny`` (default; the benchmark's ~3M-parameter Qwen2 and character tokenizer)
or ``--model smollm2`` (SmolLM2-135M-Instruct, bench/real_model.py), fp32 on CPU, 16
conversations per optimizer step, at most 512 tokens each, AdamW at lr 1e-5 without weight
decay, gradients clipped at norm 1, and the loss over the assistant's tokens only. The rows are
:func:`dpo_step.pairs`' prompts with their chosen responses (``--lengths varied`` by default):
one user turn and one assistant turn, rendered by the model's chat template on both sides.
tandem reads them as ``messages``; TRL as prompt-completion rows, so that its default
``completion_only_loss`` masks the prompt as tandem does (the tokens are the same).
TRL keeps its defaults otherwise (padded batches, no packing) with ``use_cpu=True, bf16=False,
gradient_checkpointing=False``; ``--trl-python`` names the interpreter of a separate
environment holding TRL.

Each side runs in a fresh process of its own for ``--rounds`` rounds that alternate which side
goes first; ``--warmup`` untimed steps, then ``--steps`` timed ones; medians and their ratio
are printed (bench/side_by_side.py). TRL is optional: without it only tandem's numbers print.

    python bench/sft_step.py [--model tiny|smollm2] [--steps 8] [--warmup 2] [--rounds 3]
        [--lengths varied|uniform] [--trl-python /work/trl-venv/bin/python] [--profile sft.txt]

``--profile PATH`` then runs one more tandem child under ``py-spy record --native`` (py-spy
must be on ``PATH``; 20 samples/s, wall clock), writes its collapsed stacks to ``PATH`` and
prints the functions holding the most samples (self and inclusive).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dpo_step import pairs  # noqa: E402
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
from tandem.models import load_model, load_tokenizer, save_tiny_model  # noqa: E402
from tandem.sft import SFTConfig, SFTTrainer  # noqa: E402

ROWS, LR, MAX_LENGTH = 16, 1e-5, 512


def conversations(rows: list[dict]) -> list[dict]:
    """Each pair's prompt and chosen response as one conversation (tandem's ``messages`` rows)."""
    return [{"messages": row["prompt"] + row["chosen"]} for row in rows]


def time_tandem(root: Path, steps: int, warmup: int) -> dict[str, list[float]]:
    config = config_from_overrides(
        SFTConfig,
        [
            f"model_path={root / 'model'}",
            f"data.train_path={root / 'data.jsonl'}",
            f"data.max_length={MAX_LENGTH}",
            f"engine.lr={LR}",
            f"trainer.global_batch_size={ROWS}",
            f"trainer.total_steps={warmup + steps}",
            "trainer.log_every=1000",
            "trainer.report=false",
            f"trainer.output_dir={root / 'tandem'}",
        ],
    )
    trainer = SFTTrainer(config)
    trainer.fit()
    return {"step": [h["timing_s/step"] for h in trainer.record.history[warmup:]]}


def time_trl(root: Path, steps: int, warmup: int) -> list[float] | None:
    try:
        from datasets import Dataset
        from trl import SFTConfig as TRLConfig
        from trl import SFTTrainer as TRLTrainer
    except ImportError:
        return None
    rows = [json.loads(line) for line in (root / "data.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list(
        [{"prompt": row["messages"][:1], "completion": row["messages"][1:]} for row in rows]
    )
    args = TRLConfig(
        output_dir=str(root / "trl"),
        per_device_train_batch_size=ROWS,
        learning_rate=LR,
        max_length=MAX_LENGTH,
        max_steps=warmup + steps,
        **TRL_CPU_ARGS,
    )
    timer = step_timer()
    trainer = TRLTrainer(
        model=load_model(root / "model"),
        args=args,
        train_dataset=dataset,
        processing_class=load_tokenizer(root / "model"),
        callbacks=[timer],
    )
    trainer.train()
    return timer.times[warmup:]


def child(side: str, root: Path, steps: int, warmup: int) -> None:
    run_child(side, lambda: time_tandem(root, steps, warmup), lambda: time_trl(root, steps, warmup))


def profile_tandem(root: Path, steps: int, warmup: int, out: Path, top: int = 15) -> None:
    """One tandem child under py-spy: collapsed stacks to ``out``, the top functions printed."""
    child_run = [
        sys.executable,
        __file__,
        "--side",
        "tandem",
        "--root",
        str(root),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
    ]
    command = [
        "py-spy",
        "record",
        "--native",
        "--rate",
        "20",
        "--format",
        "raw",
        "--output",
        str(out),
        "--",
        *child_run,
    ]
    subprocess.run(command, check=True, capture_output=True)
    own, inclusive, total = Counter(), Counter(), 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f.split(" (")[0] for f in stack.split(";")]
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    print(f"py-spy of tandem's SFT child: {total} samples ({out})")
    for label, counts in (("self", own), ("inclusive", inclusive)):
        print(f"top {top} by {label} samples:")
        for frame, count in counts.most_common(top):
            print(f"  {count / total:6.1%}  {frame}")


def main() -> None:
    parser = side_parser(__doc__)
    parser.add_argument(
        "--profile", type=Path, help="also profile one tandem child with py-spy into this file"
    )
    parser.add_argument("--model", choices=MODELS, default="tiny")
    parser.add_argument("--lengths", choices=["varied", "uniform"], default="varied")
    args = parser.parse_args()
    if args.side:
        child(args.side, args.root, args.steps, args.warmup)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = link_model(root) if args.model == "smollm2" else save_tiny_model(root / "model", BENCH_MODEL)
        rows = conversations(pairs(ROWS * (args.steps + args.warmup), varied=args.lengths == "varied"))
        (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        params = sum(p.numel() for p in load_model(model).parameters())
        print(describe_machine())
        print(baseline_versions(args.trl_python))
        print(
            f"model: {args.model}, {params / 1e6:.2f}M parameters, fp32; {ROWS} conversations per step, "
            f"{args.lengths} lengths, <= {MAX_LENGTH} tokens"
        )
        if args.rounds:  # --rounds 0 --profile PATH: the profile only
            compare(
                __file__,
                root,
                args.rounds,
                args.steps,
                args.warmup,
                "TRL SFTTrainer",
                "SFT step",
                args.trl_python,
            )
        if args.profile:
            profile_tandem(root, args.steps, args.warmup, args.profile.resolve())


if __name__ == "__main__":
    main()
