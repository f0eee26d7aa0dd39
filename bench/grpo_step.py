"""Seconds per GRPO step: tandem's trainer vs TRL's GRPOTrainer on the same model, prompts and settings.

Both: the benchmark's ~3M-parameter Qwen2 (hidden 256, 4 layers), fp32 on CPU, 8 prompts x 8
responses = 64 per step, up to 64 new tokens at temperature 1, no KL term, one optimizer step
per step, the same reward function. TRL runs with ``use_cpu=True, bf16=False,
gradient_checkpointing=False`` and no vLLM (transformers ``generate``).

Each side runs in a fresh process of its own, as its users run it (tandem's process-wide CPU
settings, e.g. its malloc tuning, never reach TRL's run), for ``--rounds`` rounds that
alternate which side goes first (the machine's speed drifts). A run does ``--warmup``
untimed steps, then ``--steps`` timed ones; the median over all timed steps of all rounds
is reported and the ratio printed; each tandem round also prints the medians of its
generation and actor-update phases. TRL is optional: without it only tandem's numbers are
printed.

    python bench/grpo_step.py [--steps 8] [--warmup 2] [--rounds 3]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402
from side_by_side import TRL_CPU_ARGS, compare, run_child, side_parser, step_timer  # noqa: E402

from tandem.data import write_parquet  # noqa: E402
from tandem.models import TinyModelConfig, save_tiny_model  # noqa: E402
from tandem.rl import RLTrainer, load_train_config  # noqa: E402
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows

BENCH_MODEL = TinyModelConfig(
    hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768
)
PROMPTS, RESPONSES, NEW_TOKENS, LR = 8, 8, 64, 1e-5
REWARD_SOURCE = (
    "def compute_score(data_source, solution, ground_truth, extra_info):\n"
    "    return sum(c.isdigit() for c in solution) / max(len(solution), 1)\n"
)


def digit_share(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


TANDEM_PHASES = ("gen", "update_actor")  # printed per round next to the step time


def time_tandem(root: Path, model: Path, data: Path, steps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of each timed step (``step``) and of its main phases (:data:`TANDEM_PHASES`)."""
    reward = root / "reward.py"
    reward.write_text(REWARD_SOURCE)
    config = load_train_config(
        [
            "preset=grpo",
            f"model_path={model}",
            f"data.train_path={data}",
            f"data.train_batch_size={PROMPTS}",
            f"rollout.n={RESPONSES}",
            f"rollout.max_response_length={NEW_TOKENS}",
            "algorithm.kl.use_kl_loss=false",
            f"actor.engine.lr={LR}",
            f"reward.custom_path={reward}",
            f"trainer.total_steps={warmup + steps}",
            "trainer.loggers=[]",
            "trainer.report=false",
            "trainer.export_hf=false",
            "trainer.resume=disable",
            f"trainer.output_dir={root / 'tandem'}",
        ]
    )
    history = RLTrainer(config).fit().history[warmup:]
    return {name: [h[f"timing_s/{name}"] for h in history] for name in ("step", *TANDEM_PHASES)}


def time_trl(root: Path, model: Path, data_rows: list[dict], steps: int, warmup: int) -> list[float] | None:
    try:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        return None
    from tandem.models import load_tokenizer

    def reward(completions, **kwargs) -> list[float]:
        return [digit_share(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    dataset = Dataset.from_list([{"prompt": row["prompt"]} for row in data_rows])
    args = GRPOConfig(
        output_dir=str(root / "trl"),
        per_device_train_batch_size=PROMPTS * RESPONSES,
        num_generations=RESPONSES,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        learning_rate=LR,
        beta=0.0,
        max_steps=warmup + steps,
        **TRL_CPU_ARGS,
    )
    timer = step_timer()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
        reward_funcs=[reward],
        args=args,
        train_dataset=dataset,
        processing_class=load_tokenizer(model),
        callbacks=[timer],
    )
    trainer.train()
    return timer.times[warmup:]


def child(side: str, root: Path, steps: int, warmup: int) -> None:
    rows = arithmetic_rows(2_000, ArithmeticTaskConfig(max_digits=3), seed=0)
    run_child(
        side,
        lambda: time_tandem(root, root / "model", root / "prompts.parquet", steps, warmup),
        lambda: time_trl(root, root / "model", rows, steps, warmup),
    )


def prepare(root: Path) -> int:
    """Write the benchmark's model (``root/model``) and prompts (``root/prompts.parquet``), which
    every child run reads; returns the model's parameter count."""
    model = save_tiny_model(root / "model", BENCH_MODEL)
    rows = arithmetic_rows(2_000, ArithmeticTaskConfig(max_digits=3), seed=0)
    write_parquet(rows, root / "prompts.parquet")
    return sum(p.numel() for p in __import__("tandem").models.load_model(model).parameters())


def main() -> None:
    parser = side_parser(__doc__)
    args = parser.parse_args()
    if args.side:
        child(args.side, args.root, args.steps, args.warmup)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        params = prepare(root)
        print(describe_machine())
        print(
            f"model: {params / 1e6:.2f}M parameters, fp32; {PROMPTS} prompts x {RESPONSES} responses, <= {NEW_TOKENS} new tokens"
        )
        compare(__file__, root, args.rounds, args.steps, args.warmup, "TRL GRPOTrainer", "GRPO step")


if __name__ == "__main__":
    main()
