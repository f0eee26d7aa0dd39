"""The main demo: a tiny model learns 2-digit addition — SFT on a flawed teacher, then GRPO.

Everything is built locally (no download): a character tokenizer, a ~0.4M-parameter Qwen2
model and the synthetic arithmetic task. The SFT warm-up imitates a *flawed teacher* whose
answers are one too high 80% of the time: the model learns the format and the arithmetic, but
its greedy answer copies the teacher's slip, so held-out accuracy starts low. GRPO then uses
only the exact-match reward (a verifier) to find and reinforce the right answers — the
situation RL post-training is for. Validation problems never appear in any training data.

(With clean SFT data stopped early instead, the same GRPO settings lift accuracy only from
~25% to ~50% in 200 steps on this model: reinforcement sharpens what the model can already
sample far faster than it teaches a skill from scratch. docs/benchmarks.md has both curves.)
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from transformers.utils import logging as hf_logging

from tandem.config.validation import check_choice
from tandem.data import write_parquet
from tandem.demos.accuracy import ACCURACY_KEY as ACCURACY_KEY  # where tests/pipeline reads it
from tandem.demos.accuracy import accuracy_curve, accuracy_table
from tandem.demos.settings import DemoRunSettings, check_mini_batch, check_pipeline, check_share
from tandem.engine import EngineConfig
from tandem.models import TinyModelConfig, save_tiny_model
from tandem.rl.config_loader import load_train_config
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows
from tandem.rl.trainer import RLResult, RLTrainer
from tandem.sft import SFTConfig, SFTTrainer
from tandem.sft.config import SFTTrainerConfig
from tandem.sft.data import SFTDataConfig

if TYPE_CHECKING:
    from tandem.demos.vlm import VLMDemoSettings

PRESETS = ("grpo", "ppo", "online_dpo")  # the RL runs the demo's README measures after its warm-up
TASK = ArithmeticTaskConfig(min_digits=1, max_digits=2, num_operands=2, operators="+")
MODEL = TinyModelConfig(
    family="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    intermediate_size=384, max_position_embeddings=128,
)  # fmt: skip


@dataclass(frozen=True)
class DemoSettings(DemoRunSettings):
    """Sizes of the demo (the defaults are what the README's numbers were measured with): the
    shared warm-up and RL sizes (:class:`~tandem.demos.settings.DemoRunSettings`, whose defaults
    are this demo's) and these.

    ``mini_batch_prompts``: prompts per optimizer step; it divides ``prompts_per_step``.
    ``teacher_error_rate``: share of SFT demonstrations whose answer is one too high.
    ``pipeline``: GRPO's ``pipeline.mode``; the asynchronous ones run the rollout in a process
    of its own, and the trainer and the rollout get one CPU thread each.
    ``sft_model_dir``: start GRPO from this finished warm-up instead of running step 1.
    ``preset``: the RL preset after the warm-up: ``grpo``, ``ppo`` (GAE advantages from a critic
        that starts from the warmed-up model with a fresh value head), or ``online_dpo``
        (best/worst pairs of each prompt's responses, ranked by the same reward, trained with
        the DPO loss).
    ``overrides``: extra ``key=value`` settings for the RL run.
    """

    mini_batch_prompts: int = 64
    teacher_error_rate: float = 0.8
    pipeline: str = "sync"
    sft_model_dir: str = ""
    preset: str = "grpo"
    overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        check_mini_batch(owner, self.mini_batch_prompts, self.prompts_per_step)
        check_share(owner, "teacher_error_rate", self.teacher_error_rate)
        check_pipeline(owner, self.pipeline)
        check_choice(owner, "preset", self.preset, PRESETS)


def write_demo_data(root: Path, settings: DemoSettings) -> dict[str, Path]:
    """SFT conversations, RL prompts and held-out validation prompts (no expression shared with training)."""
    val = arithmetic_rows(settings.val_prompts, TASK, seed=settings.seed + 1, split="test")
    held_out = {row["extra_info"]["expression"] for row in val}

    def unseen(rows: list[dict]) -> list[dict]:
        return [row for row in rows if row["extra_info"]["expression"] not in held_out]

    sft_rows = unseen(arithmetic_rows(40_000, TASK, seed=settings.seed + 2))
    rl_rows = unseen(arithmetic_rows(20_000, TASK, seed=settings.seed + 3))
    sft_path = root / "data" / "sft.jsonl"
    sft_path.parent.mkdir(parents=True, exist_ok=True)
    flawed = random.Random(settings.seed)
    with sft_path.open("w") as file:
        for row in sft_rows:
            value = int(row["reward_model"]["ground_truth"])
            if flawed.random() < settings.teacher_error_rate:
                value += 1  # the flawed teacher's systematic slip
            answer = {"role": "assistant", "content": str(value)}
            file.write(json.dumps({"messages": [*row["prompt"], answer]}) + "\n")
    return {
        "sft": sft_path,
        "train": write_parquet(rl_rows, root / "data" / "train.parquet"),
        "val": write_parquet(val, root / "data" / "val.parquet"),
    }


def warm_up(settings: DemoSettings, base: Path, paths: dict[str, Path], root: Path, console: Console) -> Path:
    """Step 1: SFT on the flawed teacher's demonstrations; returns the fine-tuned model directory."""
    console.rule(
        f"1. SFT warm-up ({settings.sft_steps} steps) on a teacher that answers one too high "
        f"{settings.teacher_error_rate:.0%} of the time"
    )
    return sft_warm_up(settings, base, paths["sft"], 64, root / "sft", 60, console)


def sft_warm_up(
    settings: DemoRunSettings,
    base: Path,
    data: Path,
    max_length: int,
    output_dir: Path,
    log_every: int,
    console: Console,
) -> Path:
    """SFT of ``base`` on the conversations in ``data`` with the demo's ``sft_*`` sizes and seed;
    returns the fine-tuned model directory."""
    sft = SFTTrainer(
        SFTConfig(
            model_path=str(base),
            data=SFTDataConfig(train_path=str(data), max_length=max_length),
            engine=EngineConfig(lr=settings.sft_lr, seed=settings.seed),
            trainer=SFTTrainerConfig(
                global_batch_size=settings.sft_batch_size,
                total_steps=settings.sft_steps,
                log_every=log_every,
                output_dir=str(output_dir),
                seed=settings.seed,
            ),
        ),
        console,
    ).fit()
    return sft.hf_model_dir


# The critic starts from the warmed-up policy with a fresh value head: it gets the policy's
# learning rate and a few steps of its own before the actor moves.
PPO_DEMO = ("critic.engine.lr=1e-3", "critic.warmup_steps=3")


def pipeline_overrides(mode: str) -> list[str]:
    """``pipeline.mode=<mode>``; the asynchronous modes give each side one thread (of 2 cores)."""
    overrides = [f"pipeline.mode={mode}"]
    if mode != "sync":
        overrides += ["pipeline.trainer_threads=1", "pipeline.rollout_threads=1"]
    return overrides


def rl_overrides(
    settings: DemoSettings, sft_model: str, paths: dict[str, Path], root: Path, run_name: str = ""
) -> list[str]:
    """The RL run's settings: the preset from the warmed-up model on the demo's prompts
    (:func:`rl_run_overrides`), the pipeline, and ``settings.overrides`` last. The run writes to
    ``root / run_name`` (default: the preset's name)."""
    run_name = run_name or settings.preset
    return [
        *rl_run_overrides(
            settings, settings.preset, sft_model, paths, root / run_name,
            f"demo-{run_name.replace('_', '-')}-arithmetic", prompt_length=64, response_length=8,
        ),
        *pipeline_overrides(settings.pipeline),
        *(PPO_DEMO if settings.preset == "ppo" else ()),
        *settings.overrides,
    ]  # fmt: skip


def rl_run_overrides(
    settings: DemoSettings | VLMDemoSettings,
    preset: str,
    sft_model: str | Path,
    paths: dict[str, Path],
    output_dir: Path,
    experiment: str,
    prompt_length: int,
    response_length: int,
) -> list[str]:
    """What every demo's RL run sets: ``preset`` from the warmed-up ``sft_model`` on the demo's
    train and validation prompts, ``settings``' batch, group size and learning rate with a cosine
    schedule over the run's optimizer steps, validation every ``val_every`` steps, a fresh run in
    ``output_dir``. ``settings``: a demo's settings (``rl_steps``, ``prompts_per_step``,
    ``responses_per_prompt``, ``mini_batch_prompts``, ``rl_lr``, ``val_every``, ``seed``)."""
    optimizer_steps = settings.rl_steps * settings.prompts_per_step // settings.mini_batch_prompts
    return [
        f"preset={preset}",
        f"model_path={sft_model}",
        f"data.train_path={paths['train']}",
        f"data.val_path={paths['val']}",
        f"data.train_batch_size={settings.prompts_per_step}",
        f"data.max_prompt_length={prompt_length}",
        f"rollout.n={settings.responses_per_prompt}",
        f"rollout.max_response_length={response_length}",
        f"actor.engine.lr={settings.rl_lr}",
        "actor.engine.lr_schedule=cosine",
        f"actor.engine.total_steps={optimizer_steps}",
        "actor.engine.min_lr_ratio=0.1",
        f"actor.ppo_mini_batch_size={settings.mini_batch_prompts}",
        f"trainer.total_steps={settings.rl_steps}",
        f"trainer.val_every={settings.val_every}",
        f"trainer.output_dir={output_dir}",
        "trainer.resume=disable",
        f"trainer.seed={settings.seed}",
        f"trainer.experiment={experiment}",
    ]


def run_demo(settings: DemoSettings | None = None, console: Console | None = None) -> RLResult:
    """Build, warm up with SFT, train with GRPO, and print held-out accuracy before and after."""
    settings = settings or DemoSettings()
    console = console or Console()
    hf_logging.disable_progress_bar()
    root = Path(settings.output_dir)
    started = time.monotonic()
    console.rule(f"tandem demo: 2-digit addition, SFT on a flawed teacher, then {settings.preset}")
    base = save_tiny_model(root / "base_model", MODEL)
    paths = write_demo_data(root, settings)
    console.print(f"model and tokenizer in {base}; data in {paths['train'].parent}")

    sft_model = settings.sft_model_dir or str(warm_up(settings, base, paths, root, console))
    console.rule(
        f"2. {settings.preset} ({settings.rl_steps} steps of {settings.prompts_per_step} prompts x {settings.responses_per_prompt}"
        f", pipeline {settings.pipeline})"
    )
    config = load_train_config(rl_overrides(settings, sft_model, paths, root))
    result = RLTrainer(config, console).fit()

    method = settings.preset.upper().replace("_", " ").replace("ONLINE DPO", "online DPO")
    title = "held-out greedy accuracy (256 unseen problems)"
    console.print(accuracy_table(title, method, accuracy_curve(result)))
    console.print(
        f"total time {time.monotonic() - started:.0f} s; report: {result.report}; final model: {result.hf_model_dir}"
    )
    return result
