"""Seconds per GRPO step: tandem's trainer vs TRL's GRPOTrainer on the same model, prompts and settings.

Both: ``--model tiny`` (default), the benchmark's ~3M-parameter Qwen2 (hidden 256, 4 layers)
and character-level arithmetic prompts, 8 prompts x 8 responses = 64 per step, up to 64 new
tokens; or ``--model smollm2``, SmolLM2-135M-Instruct (bench/real_model.py) on chat-templated
arithmetic questions, 8 prompts x 4 responses, up to 32 new tokens. fp32 on CPU, temperature 1,
no KL term (no reference model on either side), one optimizer step per step, the same reward
function (the share of digits in the response), the same prompt rows (each sampler shuffles
them its own way). TRL runs with ``use_cpu=True, bf16=False, gradient_checkpointing=False`` and
no vLLM (transformers ``generate``); ``--trl-python`` names the interpreter of a separate
environment holding TRL.

Each side runs in a fresh process of its own, as its users run it (tandem's process-wide CPU
settings, e.g. its malloc tuning, never reach TRL's run), for ``--rounds`` rounds that
alternate which side goes first (the machine's speed drifts). A run does ``--warmup``
untimed steps, then ``--steps`` timed ones; the median over all timed steps of all rounds
is reported and the ratio printed; each tandem round also prints the medians of its
generation and actor-update phases. TRL is optional: without it only tandem's numbers are
printed.

    python bench/grpo_step.py [--model tiny|smollm2] [--steps 8] [--warmup 2] [--rounds 3]
        [--trl-python /work/trl-venv/bin/python]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402
from real_model import MODELS, arithmetic_chat_rows, link_model  # noqa: E402
from side_by_side import (  # noqa: E402
    TRL_CPU_ARGS,
    baseline_versions,
    compare,
    run_child,
    side_parser,
    step_timer,
)

from tandem.data import write_parquet  # noqa: E402
from tandem.models import TinyModelConfig, save_tiny_model  # noqa: E402
from tandem.rl import RLTrainer, load_train_config  # noqa: E402
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows

BENCH_MODEL = TinyModelConfig(
    hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768
)
LR = 1e-5
# prompts per step, responses per prompt, new tokens at most: per --model
SHAPES = {"tiny": (8, 8, 64), "smollm2": (8, 4, 32)}
REWARD_SOURCE = (
    "def compute_score(data_source, solution, ground_truth, extra_info):\n"
    "    return sum(c.isdigit() for c in solution) / max(len(solution), 1)\n"
)


def digit_share(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


TANDEM_PHASES = ("gen", "update_actor")  # printed per round next to the step time


def shape(root: Path) -> tuple[int, int, int]:
    """The run's prompts per step, responses per prompt and new tokens, as the parent wrote them."""
    return tuple(json.loads((root / "shape.json").read_text()))


def time_tandem(root: Path, model: Path, data: Path, steps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of each timed step (``step``) and of its main phases (:data:`TANDEM_PHASES`)."""
    prompts, responses, new_tokens = shape(root)
    reward = root / "reward.py"
    reward.write_text(REWARD_SOURCE)
    config = load_train_config(
        [
            "preset=grpo",
            f"model_path={model}",
            f"data.train_path={data}",
            f"data.train_batch_size={prompts}",
            f"rollout.n={responses}",
            f"rollout.max_response_length={new_tokens}",
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

    prompts, responses, new_tokens = shape(root)

    def reward(completions, **kwargs) -> list[float]:
        return [digit_share(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    dataset = Dataset.from_list([{"prompt": row["prompt"]} for row in data_rows])
    args = GRPOConfig(
        output_dir=str(root / "trl"),
        per_device_train_batch_size=prompts * responses,
        num_generations=responses,
        max_completion_length=new_tokens,
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
    rows = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines()]
    run_child(
        side,
        lambda: time_tandem(root, root / "model", root / "prompts.parquet", steps, warmup),
        lambda: time_trl(root, root / "model", rows, steps, warmup),
    )


def prepare(root: Path, model_name: str = "tiny") -> int:
    """Write the benchmark's model (``root/model``: the tiny one, or a link to SmolLM2's converted
    directory), its shape (``root/shape.json``) and prompts (``root/prompts.parquet`` for tandem,
    the same rows in ``root/prompts.jsonl`` for TRL), which every child run reads; returns the
    model's parameter count."""
    if model_name == "smollm2":
        model = link_model(root)
        rows = arithmetic_chat_rows(2_000, seed=0)
    else:
        model = save_tiny_model(root / "model", BENCH_MODEL)
        rows = arithmetic_rows(2_000, ArithmeticTaskConfig(max_digits=3), seed=0)
    (root / "shape.json").write_text(json.dumps(SHAPES[model_name]))
    write_parquet(rows, root / "prompts.parquet")
    (root / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return sum(p.numel() for p in __import__("tandem").models.load_model(model).parameters())


def main() -> None:
    parser = side_parser(__doc__)
    parser.add_argument("--model", choices=MODELS, default="tiny")
    args = parser.parse_args()
    if args.side:
        child(args.side, args.root, args.steps, args.warmup)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        params = prepare(root, args.model)
        prompts, responses, new_tokens = SHAPES[args.model]
        print(describe_machine())
        print(baseline_versions(args.trl_python))
        print(
            f"model: {args.model}, {params / 1e6:.2f}M parameters, fp32; {prompts} prompts x {responses} responses, <= {new_tokens} new tokens"
        )
        compare(
            __file__,
            root,
            args.rounds,
            args.steps,
            args.warmup,
            "TRL GRPOTrainer",
            "GRPO step",
            args.trl_python,
        )


if __name__ == "__main__":
    main()
