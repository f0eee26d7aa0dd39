"""The vision-language demo: a tiny Qwen2-VL learns to answer questions about generated pictures.

Everything is built locally: a tiny Qwen2-VL (a 2-block vision tower and a 2-layer language
model, ~0.7M parameters) with its image processor, and the ``shapes`` task
(:mod:`tandem.rl.data.shapes`): pictures of coloured shapes with questions only the picture
answers (how many red shapes, which colour is the largest, is the circle left of the square).

As in the main demo, the SFT warm-up imitates a *flawed teacher*: most of its answers are
slipped by a fixed rule (the next count, the next colour, yes for no), so the model learns
to read the picture and the format but answers with the slip. GRPO then uses only the
exact-match reward to find the right answers. Validation pictures never appear in training.

The control: the final model answers the same held-out questions with every picture
replaced by an empty canvas. If the policy reads the picture, that accuracy falls to about
what guessing gets (:data:`~tandem.rl.data.shapes.CHANCE`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

from PIL import Image
from rich.console import Console
from transformers.utils import logging as hf_logging

from tandem.data import write_parquet
from tandem.data.images import decode_image
from tandem.data.rows import read_rows
from tandem.demos.accuracy import accuracy_curve, accuracy_table
from tandem.demos.arithmetic import rl_run_overrides, sft_warm_up
from tandem.demos.settings import DemoRunSettings, check_count, check_mini_batch, check_share
from tandem.models import load_tokenizer
from tandem.models.chat import template_ids, with_image_parts
from tandem.models.tiny_vlm import TinyVLMConfig, save_tiny_vlm
from tandem.models.vision import ImagePrompter
from tandem.protocol.generation import RolloutRequest, SamplingParams
from tandem.rl.config_loader import load_train_config
from tandem.rl.data.shapes import ANSWERS, BACKGROUND, CHANCE, png_bytes, shapes_rows
from tandem.rl.rewards.scorers import shapes_score
from tandem.rl.trainer import RLResult, RLTrainer
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine

ACCURACY_KEY = "val-core/shapes/acc/mean@1"
QUESTIONS = ("count", "largest")  # has_circle and left_of: beyond this model's budget (docs/multimodal.md)
MODEL = TinyVLMConfig(family="qwen2_vl", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2)


@dataclass(frozen=True)
class VLMDemoSettings(DemoRunSettings):
    """Sizes of the VLM demo (the defaults are what the README's numbers were measured with): the
    shared warm-up and RL sizes (:class:`~tandem.demos.settings.DemoRunSettings`) and these.

    ``sft_rows`` / ``train_rows``: pictures generated for the warm-up and for GRPO.
    ``mini_batch_prompts``: prompts per optimizer step; it divides ``prompts_per_step``.
    ``teacher_error_rate``: share of SFT demonstrations whose answer is slipped (:func:`slip`).
    ``sft_model_dir``: start GRPO from this finished warm-up instead of running step 1.
    ``overrides``: extra ``key=value`` settings for the GRPO run.
    """

    output_dir: str = "outputs/demo-vlm"
    sft_steps: int = 300
    sft_batch_size: int = 64
    sft_lr: float = 2e-3
    rl_steps: int = 30
    prompts_per_step: int = 32
    rl_lr: float = 1e-3
    val_prompts: int = 128
    val_every: int = 5
    sft_rows: int = 6000
    train_rows: int = 4000
    mini_batch_prompts: int = 32
    teacher_error_rate: float = 0.8
    sft_model_dir: str = ""
    overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        check_count(owner, "sft_rows", self.sft_rows)
        check_count(owner, "train_rows", self.train_rows)
        check_mini_batch(owner, self.mini_batch_prompts, self.prompts_per_step)
        check_share(owner, "teacher_error_rate", self.teacher_error_rate)


def slip(question: str, truth: str) -> str:
    """The flawed teacher's answer: the next answer of the question's kind, in a fixed order
    (a count one too high, wrapping; the next colour; yes for no and no for yes)."""
    answers = ANSWERS[question]
    return answers[(answers.index(truth) + 1) % len(answers)]


def write_demo_data(root: Path, settings: VLMDemoSettings) -> dict[str, Path]:
    """SFT conversations (the flawed teacher's answers), GRPO prompts and held-out prompts, each
    with its picture; the splits are drawn from different seeds."""
    flawed = random.Random(settings.seed)
    sft = []
    for row in shapes_rows(settings.sft_rows, settings.seed + 2, split="sft", questions=QUESTIONS):
        truth = row["reward_model"]["ground_truth"]
        if flawed.random() < settings.teacher_error_rate:
            truth = slip(row["extra_info"]["question"], truth)
        sft.append(
            {"messages": [*row["prompt"], {"role": "assistant", "content": truth}], "images": row["images"]}
        )
    data = root / "data"
    return {
        "sft": write_parquet(sft, data / "sft.parquet"),
        "train": write_parquet(
            shapes_rows(settings.train_rows, settings.seed + 3, split="train", questions=QUESTIONS),
            data / "train.parquet",
        ),
        "val": write_parquet(
            shapes_rows(settings.val_prompts, settings.seed + 1, split="test", questions=QUESTIONS),
            data / "val.parquet",
        ),
    }


def warm_up(settings: VLMDemoSettings, base: Path, sft_data: Path, root: Path, console: Console) -> Path:
    """Step 1: SFT on the flawed teacher's answers; returns the fine-tuned model directory."""
    console.rule(
        f"1. SFT warm-up ({settings.sft_steps} steps) on a teacher whose answer slips "
        f"{settings.teacher_error_rate:.0%} of the time"
    )
    return sft_warm_up(settings, base, sft_data, 128, root / "sft", 50, console)


def grpo_overrides(
    settings: VLMDemoSettings, sft_model: Path, paths: dict[str, Path], root: Path
) -> list[str]:
    """The GRPO run's settings: from the warmed-up model on the shapes prompts, validated every
    ``val_every`` steps, ``settings.overrides`` last."""
    return [
        *rl_run_overrides(
            settings,
            "grpo",
            sft_model,
            paths,
            root / "grpo",
            "demo-grpo-shapes",
            prompt_length=128,
            response_length=6,
        ),
        *settings.overrides,
    ]


def blank_png(canvas: int = 112) -> bytes:
    """An empty canvas: the background colour alone."""
    return png_bytes(Image.new("RGB", (canvas, canvas), BACKGROUND))


def greedy_accuracy(model_dir: str | Path, val_data: list[dict], blank: bool) -> float:
    """Held-out greedy accuracy of ``model_dir`` on ``val_data`` (rows of the shapes task), with
    each picture replaced by an empty canvas when ``blank``."""
    tokenizer = load_tokenizer(model_dir)
    prompter = ImagePrompter.for_model(model_dir)
    assert prompter is not None, f"{model_dir} is not a vision-language model"
    engine = NativeRolloutEngine.from_pretrained(
        str(model_dir), NativeEngineConfig(max_num_seqs=64, max_model_len=256)
    )
    try:
        requests = []
        for i, row in enumerate(val_data):
            messages, _ = with_image_parts(list(row["prompt"]))
            ids = template_ids(tokenizer, messages, add_generation_prompt=True)
            raw = blank_png() if blank else row["images"][0]["bytes"]
            prompt, images = prompter.prompt(ids, [decode_image(raw)])
            requests.append(
                RolloutRequest(
                    f"control-{i}", tuple(prompt), SamplingParams(temperature=0.0, max_tokens=6), images
                )
            )
        completions = engine.generate_batch(requests)
    finally:
        engine.close()
    scores = [
        shapes_score(
            tokenizer.decode(c.token_ids, skip_special_tokens=True), row["reward_model"]["ground_truth"], {}
        )
        for c, row in zip(completions, val_data, strict=True)
    ]
    return sum(scores) / len(scores)


def chance_level(val_data: list[dict]) -> float:
    """What uniform guessing within each question's answers scores on ``val_data``."""
    return sum(CHANCE[row["extra_info"]["question"]]["uniform_guess"] for row in val_data) / len(val_data)


def run_vlm_demo(
    settings: VLMDemoSettings | None = None, console: Console | None = None
) -> tuple[RLResult, float]:
    """Build, warm up with SFT, train with GRPO; print held-out accuracy before and after, and the
    blanked-picture control. Returns the GRPO run and the control's accuracy."""
    settings = settings or VLMDemoSettings()
    console = console or Console()
    hf_logging.disable_progress_bar()
    root = Path(settings.output_dir)
    started = time.monotonic()
    console.rule("tandem demo: questions about pictures, a tiny Qwen2-VL, SFT on a flawed teacher, then GRPO")
    base = save_tiny_vlm(root / "base_model", MODEL)
    paths = write_demo_data(root, settings)
    console.print(f"model, tokenizer and image processor in {base}; data in {paths['train'].parent}")
    sft_model = (
        Path(settings.sft_model_dir)
        if settings.sft_model_dir
        else warm_up(settings, base, paths["sft"], root, console)
    )
    console.rule(
        f"2. GRPO ({settings.rl_steps} steps of {settings.prompts_per_step} prompts x {settings.responses_per_prompt})"
    )
    result = RLTrainer(load_train_config(grpo_overrides(settings, sft_model, paths, root)), console).fit()
    val_data = read_rows(paths["val"])
    control = greedy_accuracy(result.hf_model_dir, val_data, blank=True)
    curve = accuracy_curve(result, ACCURACY_KEY)
    table = accuracy_table(
        f"held-out greedy accuracy ({settings.val_prompts} unseen pictures)", "GRPO", curve
    )
    table.add_row("control: final model, pictures blanked", f"{control:.1%}")
    table.add_row("chance (uniform guess per question)", f"{chance_level(val_data):.1%}")
    console.print(table)
    console.print(
        f"total time {time.monotonic() - started:.0f} s; report: {result.report}; final model: {result.hf_model_dir}"
    )
    return result, control
