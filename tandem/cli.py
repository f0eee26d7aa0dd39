"""The ``tandem`` command line: ``tandem demo`` and ``tandem algos``."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from tandem import __version__


def _first_line(fn: object) -> str:
    doc = (getattr(fn, "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else ""


def print_registries(console: Console) -> None:
    """One table per registry: every registered name with the first line of its docstring."""
    from tandem.algos import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES

    for title, registry in (
        ("advantage estimators (algorithm.estimator)", ADVANTAGE_ESTIMATORS),
        ("policy losses (actor.name)", POLICY_LOSSES),
        ("KL estimators (algorithm.kl.estimator)", KL_ESTIMATORS),
    ):
        table = Table(title=title, title_justify="left")
        table.add_column("name", style="bold cyan")
        table.add_column("what it computes")
        for name in registry.names():
            table.add_row(name, _first_line(registry.get(name)))
        console.print(table)
    console.print(f"loss aggregation modes (actor.loss_agg_mode): {', '.join(LOSS_AGG_MODES)}")


def run_demo(console: Console) -> None:
    """Show the registered algorithms and one worked GRPO step's advantage and losses on a toy group."""
    import torch

    from tandem.algos import (
        POLICY_LOSSES,
        AdvantageConfig,
        AdvantageInput,
        PolicyLossConfig,
        PolicyLossInput,
        compute_advantage,
        compute_policy_loss,
    )

    console.rule(f"tandem {__version__}")
    console.print(
        "This build has the foundation: the data protocol and the algorithm library. The end-to-end "
        "demo (SFT warm-up, then GRPO on arithmetic) arrives with the RL trainer; until then this "
        "command shows what is registered and runs the math on a toy batch.\n"
    )
    print_registries(console)

    console.rule("a toy GRPO group: 4 responses to one prompt, rewards 1, 0, 0, 1")
    rewards = torch.zeros(4, 3)
    rewards[[0, 3], 2] = 1.0
    mask = torch.ones(4, 3, dtype=torch.long)
    adv = compute_advantage(
        AdvantageInput(rewards, mask, torch.zeros(4, dtype=torch.long)), AdvantageConfig()
    ).advantages
    console.print(f"GRPO advantages per response: {[round(v, 4) for v in adv[:, 0].tolist()]}")
    gen = torch.Generator().manual_seed(0)
    old = torch.log(torch.full((4, 3), 0.5))
    log_probs = (old + 0.3 * torch.randn(4, 3, generator=gen)).requires_grad_(True)
    table = Table(title="each policy loss on the same batch (ratios exp(N(0, 0.3^2)))", title_justify="left")
    for column in ("loss", "value", "|grad|", "metrics"):
        table.add_column(column)
    for name in POLICY_LOSSES.names():
        inputs = PolicyLossInput(log_probs, old, adv, mask, generator=torch.Generator().manual_seed(0))
        out = compute_policy_loss(inputs, PolicyLossConfig(name=name, clip_cov_lb=-1.0))
        (grad,) = torch.autograd.grad(out.loss, log_probs)
        metrics = ", ".join(f"{k}={float(v):.3f}" for k, v in sorted(out.metrics.items()))
        table.add_row(name, f"{float(out.loss.detach()):+.4f}", f"{float(grad.norm()):.4f}", metrics)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="RL post-training for language models.")
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="the main demo (for now: the algorithm library on a toy batch)")
    commands.add_parser("algos", help="list every registered algorithm")
    sft = commands.add_parser(
        "sft", help="supervised fine-tuning on chat data: tandem sft model_path=... data.train_path=..."
    )
    sft.add_argument("--config", help="a YAML file of overrides, applied before the command-line ones")
    sft.add_argument(
        "overrides", nargs="*", help="key=value settings, e.g. trainer.total_steps=200 engine.lr=1e-4"
    )
    args = parser.parse_args(argv)
    console = Console()
    if args.command == "demo":
        run_demo(console)
    elif args.command == "sft":
        from tandem.config.overrides import config_from_overrides
        from tandem.sft import SFTConfig, SFTTrainer

        result = SFTTrainer(config_from_overrides(SFTConfig, args.overrides, args.config), console).fit()
        console.print(f"model written to {result.hf_model_dir}")
    else:
        print_registries(console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
