"""The tool demo: a tiny model learns to use a calculator for 3-digit multiplication.

The ~0.4M-parameter model cannot multiply 3-digit numbers, but it can learn to copy them into a
calculator call and copy the result back. The SFT warm-up imitates an *imperfect teacher* that
calls the calculator only ``tool_rate`` of the time and otherwise guesses (the first two digits
right, the rest random), so the warmed-up model mostly guesses and held-out accuracy starts
low. GRPO with the ``tool_agent`` loop then rewards only the final answer (exact match, partial
credit per digit): episodes that call the tool score higher, and the policy learns to call it.
Validation problems never appear in any training data.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from transformers.utils import logging as hf_logging

from tandem.data import write_parquet
from tandem.demos.accuracy import accuracy_curve, accuracy_table
from tandem.demos.arithmetic import pipeline_overrides, sft_warm_up
from tandem.demos.settings import DemoRunSettings, check_pipeline, check_share
from tandem.models import TinyModelConfig, save_tiny_model
from tandem.rl.config_loader import load_train_config
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows
from tandem.rl.trainer import RLResult, RLTrainer

TASK = ArithmeticTaskConfig(min_digits=3, max_digits=3, operators="*")
MODEL = TinyModelConfig(
    family="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    intermediate_size=384, max_position_embeddings=256,
)  # fmt: skip


def calculator_call(expression: str) -> str:
    """The ``hermes`` tool call the teacher writes."""
    return json.dumps({"name": "calculator", "arguments": {"expression": expression}}).join(
        ("<tool_call>", "</tool_call>")
    )


@dataclass(frozen=True)
class ToolDemoSettings(DemoRunSettings):
    """Sizes of the tool demo (the defaults are what the README's numbers were measured with): the
    shared warm-up and RL sizes (:class:`~tandem.demos.settings.DemoRunSettings`) and these.

    ``tool_rate``: share of the teacher's demonstrations that use the calculator; ``pipeline``:
    GRPO's ``pipeline.mode`` (in the asynchronous ones the episodes run on a rollout process).
    """

    sft_steps: int = 300
    sft_batch_size: int = 64
    rl_steps: int = 10
    prompts_per_step: int = 32
    val_prompts: int = 128
    val_every: int = 5
    tool_rate: float = 0.3
    pipeline: str = "sync"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_share(type(self).__name__, "tool_rate", self.tool_rate)
        check_pipeline(type(self).__name__, self.pipeline)


def write_tool_data(root: Path, settings: ToolDemoSettings) -> dict[str, Path]:
    """The teacher's conversations, RL prompts and held-out validation prompts."""
    val = arithmetic_rows(settings.val_prompts, TASK, seed=settings.seed + 1, split="test")
    held_out = {row["extra_info"]["expression"] for row in val}

    def unseen(rows: list[dict]) -> list[dict]:
        return [row for row in rows if row["extra_info"]["expression"] not in held_out]

    teacher = random.Random(settings.seed)
    path = root / "data" / "tool_sft.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as file:
        for row in unseen(arithmetic_rows(20_000, TASK, seed=settings.seed + 2)):
            expression, truth = row["extra_info"]["expression"], row["reward_model"]["ground_truth"]
            if teacher.random() < settings.tool_rate:
                turns = [
                    {"role": "assistant", "content": calculator_call(expression)},
                    {"role": "tool", "content": truth},
                    {"role": "assistant", "content": truth},
                ]
            else:  # a guess: the leading digits right, the rest random
                guess = truth[:2] + "".join(teacher.choice("0123456789") for _ in truth[2:])
                turns = [{"role": "assistant", "content": guess}]
            file.write(json.dumps({"messages": [*row["prompt"], *turns]}) + "\n")
    rl_rows = unseen(arithmetic_rows(5_000, TASK, seed=settings.seed + 3))
    return {
        "sft": path,
        "train": write_parquet(rl_rows, root / "data" / "tool_train.parquet"),
        "val": write_parquet(val, root / "data" / "tool_val.parquet"),
    }


def rl_overrides(settings: ToolDemoSettings, sft_model: str, paths: dict[str, Path], root: Path) -> list[str]:
    """The RL run's settings: GRPO from the warmed-up model with the ``tool_agent`` loop and the
    calculator (at most 3 turns), validation every ``val_every`` steps, and the pipeline."""
    return [
        "preset=grpo",
        f"model_path={sft_model}",
        f"data.train_path={paths['train']}",
        f"data.val_path={paths['val']}",
        f"data.train_batch_size={settings.prompts_per_step}",
        "data.max_prompt_length=32",
        f"rollout.n={settings.responses_per_prompt}",
        "rollout.max_response_length=160",
        f"actor.engine.lr={settings.rl_lr}",
        f"actor.ppo_mini_batch_size={settings.prompts_per_step}",
        "agent.name=tool_agent",
        "agent.tools=[calculator]",
        "agent.max_turns=3",
        f"trainer.total_steps={settings.rl_steps}",
        f"trainer.val_every={settings.val_every}",
        f"trainer.output_dir={root / 'tool_agent'}",
        "trainer.resume=disable",
        f"trainer.seed={settings.seed}",
        "trainer.experiment=demo-tool-agent-multiplication",
        *pipeline_overrides(settings.pipeline),
        # Asynchronous: the PPO ratio against the policy that sampled (recomputing it with the
        # trainer's newer weights, uncorrected, degenerated here: 74% at step 5, 0% at 10).
        *(["pipeline.old_log_probs=rollout"] if settings.pipeline != "sync" else []),
    ]


def run_tool_demo(settings: ToolDemoSettings | None = None, console: Console | None = None) -> RLResult:
    """Build, warm up on the imperfect teacher, train with GRPO and ``tool_agent``, and print
    held-out accuracy before and after."""
    settings = settings or ToolDemoSettings()
    console = console or Console()
    hf_logging.disable_progress_bar()
    root = Path(settings.output_dir)
    started = time.monotonic()
    console.rule("tandem demo: 3-digit multiplication with a calculator tool")
    base = save_tiny_model(root / "tool_base_model", MODEL)
    paths = write_tool_data(root, settings)
    console.rule(
        f"1. SFT warm-up ({settings.sft_steps} steps) on a teacher that uses the calculator "
        f"{settings.tool_rate:.0%} of the time and guesses otherwise"
    )
    sft_model = sft_warm_up(settings, base, paths["sft"], 200, root / "tool_sft", 50, console)
    console.rule(
        f"2. GRPO with the tool_agent loop ({settings.rl_steps} steps of {settings.prompts_per_step} "
        f"prompts x {settings.responses_per_prompt} episodes, pipeline {settings.pipeline})"
    )
    result = RLTrainer(load_train_config(rl_overrides(settings, str(sft_model), paths, root)), console).fit()
    calls = [r["agent/tool_calls/mean"] for r in result.history if "agent/tool_calls/mean" in r]
    title = f"held-out greedy accuracy ({settings.val_prompts} unseen 3-digit products)"
    console.print(accuracy_table(title, "GRPO", accuracy_curve(result)))
    console.print(
        f"calculator calls per sampled episode: {calls[0]:.2f} at step 1, {calls[-1]:.2f} at step {len(calls)}; "
        f"total time {time.monotonic() - started:.0f} s; report: {result.report}"
    )
    return result
