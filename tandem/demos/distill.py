"""The distillation demo: the main demo's GRPO-trained policy teaches the SFT warm-up it came from.

It shares the main demo's model, task and flawed-teacher SFT warm-up
(:mod:`tandem.demos.arithmetic`). GRPO from the warm-up gives the teacher (and the curve to
compare with). Then on-policy distillation starts again from the same warm-up: the student
samples, the GRPO-trained teacher scores every sampled token, and the per-token reverse KL is
the only training signal (``algorithm.distill.reward_coef=0``: the verifier's reward is logged,
never trained on). Both runs have the same prompts, sizes, learning rate and seed; the table
puts their held-out greedy accuracy side by side, with the steps each needs to reach the target.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table
from transformers.utils import logging as hf_logging

from tandem.demos.accuracy import accuracy_curve
from tandem.demos.arithmetic import MODEL, DemoSettings, rl_overrides, warm_up, write_demo_data
from tandem.demos.settings import check_share
from tandem.models import save_tiny_model
from tandem.rl.config_loader import load_train_config
from tandem.rl.trainer import RLResult, RLTrainer

DISTILL_OVERRIDES = ("algorithm.distill.objective=reverse_kl", "algorithm.distill.reward_coef=0")


@dataclass(frozen=True)
class DistillDemoSettings:
    """Sizes of the distillation demo (the defaults are what the README's numbers were measured with).

    ``runs``: the main demo's settings, for the shared warm-up and both RL runs (GRPO, then
    distillation with the same sizes); validation every ``runs.val_every`` steps.
    ``target``: the held-out accuracy whose first step the summary reports for each run.
    """

    runs: DemoSettings = field(default_factory=lambda: DemoSettings(rl_steps=40, val_every=4))
    target: float = 0.9

    def __post_init__(self) -> None:
        check_share(type(self).__name__, "target", self.target)


@dataclass
class DistillDemoResult:
    """The GRPO run (the teacher) and the distillation run from the same warm-up."""

    grpo: RLResult
    distill: RLResult


def first_step_reaching(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first validated step whose accuracy is at least ``target`` (None: never)."""
    return next((step for step, value in curve if value >= target), None)


def comparison_table(grpo: list[tuple[int, float]], distill: list[tuple[int, float]], target: float) -> Table:
    """Held-out accuracy per validated step for both runs, and the step each first reaches ``target``."""
    table = Table(title="held-out greedy accuracy (256 unseen problems)", title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("GRPO (verifier reward)", justify="right")
    table.add_column("distillation (teacher log-probs)", justify="right")
    by_step = dict(distill)
    for step, value in grpo:
        other = by_step.get(step)
        table.add_row(str(step), f"{value:.1%}", "" if other is None else f"{other:.1%}")
    reached = [first_step_reaching(curve, target) for curve in (grpo, distill)]
    table.add_row(
        f"[bold]steps to {target:.0%}",
        *(f"[bold]{'not reached' if step is None else step}" for step in reached),
    )
    return table


def run_distill_demo(
    settings: DistillDemoSettings | None = None, console: Console | None = None
) -> DistillDemoResult:
    """Warm up, train the teacher with GRPO, distil it into the warm-up, print both curves."""
    settings = settings or DistillDemoSettings()
    runs = settings.runs
    console = console or Console()
    hf_logging.disable_progress_bar()
    root = Path(runs.output_dir)
    started = time.monotonic()
    console.rule("tandem demo: 2-digit addition, a GRPO-trained teacher distilled into its SFT warm-up")
    base = save_tiny_model(root / "base_model", MODEL)
    paths = write_demo_data(root, runs)
    sft_model = runs.sft_model_dir or str(warm_up(runs, base, paths, root, console))

    console.rule(f"2. GRPO from the warm-up ({runs.rl_steps} steps): the teacher")
    grpo = RLTrainer(load_train_config(rl_overrides(runs, sft_model, paths, root)), console).fit()
    teacher = grpo.hf_model_dir
    if teacher is None:
        raise ValueError("the GRPO run exported no model to teach with: leave trainer.export_hf on")

    console.rule(
        f"3. on-policy distillation from the same warm-up ({runs.rl_steps} steps), teacher {teacher}"
    )
    distilling = dataclasses.replace(
        runs, overrides=(*runs.overrides, f"teacher.model_path={teacher}", *DISTILL_OVERRIDES)
    )
    distill = RLTrainer(
        load_train_config(rl_overrides(distilling, sft_model, paths, root, run_name="distill")), console
    ).fit()

    console.print(comparison_table(accuracy_curve(grpo), accuracy_curve(distill), settings.target))
    console.print(f"total time {time.monotonic() - started:.0f} s; distilled model: {distill.hf_model_dir}")
    return DistillDemoResult(grpo, distill)
