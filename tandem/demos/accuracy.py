"""The demos' held-out accuracy: its curve over an RL run, and the table each demo ends with."""

from __future__ import annotations

from rich.table import Table

from tandem.rl.trainer import RLResult

ACCURACY_KEY = "val-core/arithmetic/acc/mean@1"


def accuracy_curve(result: RLResult, key: str = ACCURACY_KEY) -> list[tuple[int, float]]:
    """``(step, held-out greedy accuracy)`` at each validation of the run, in order (``key``: the
    validation metric, the arithmetic task's by default)."""
    return [(r["step"], r[key]) for r in result.history if key in r]


def accuracy_table(
    title: str, method: str, curve: list[tuple[int, float]], start: str = "after SFT warm-up"
) -> Table:
    """One row per validation of ``curve``: ``start`` (``method``'s step 0: after the warm-up, or
    the base model where a demo has none), each step between, and the last one in bold."""
    table = Table(title=title, title_justify="left")
    table.add_column("stage")
    table.add_column("accuracy", justify="right")
    table.add_row(f"{start} ({method} step 0)", f"{curve[0][1]:.1%}")
    for step, value in curve[1:-1]:
        table.add_row(f"{method} step {step}", f"{value:.1%}")
    table.add_row(f"after {method} (step {curve[-1][0]})", f"[bold]{curve[-1][1]:.1%}")
    return table
