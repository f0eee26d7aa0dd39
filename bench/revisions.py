"""Seconds per step of tandem at an earlier git revision against the working tree, same run.

Answers "did this change make the CPU path slower?": a benchmark script's tandem side (its
``--side tandem --root DIR`` child run, as in ``grpo_step.py``) runs in fresh processes,
alternating between the base revision's tree (exported with ``git archive``) and this
checkout, each importing its own ``tandem``, for ``--rounds`` rounds. The inputs (model,
prompts) are written once by the current script's ``prepare(root)`` and read by both sides,
so the base revision's script must take the same child arguments and read the same files.

    python bench/revisions.py --base cee21ab [--script grpo_step.py] [--rounds 3] [--steps 8] [--warmup 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402
from side_by_side import round_line, run_side  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def export_revision(revision: str, into: Path) -> str:
    """Write the tree of ``revision`` into ``into``; returns its short commit id."""
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", f"{revision}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return commit


# Imports tandem from TREE: an editable install's import hook would otherwise win over sys.path.
IMPORT_FROM_TREE = (
    "import sys\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]\n"
    "sys.path.insert(0, {tree!r})\n"
)


def child_script(tree: Path, script: Path, into: Path) -> Path:
    """A script that runs ``script`` with tandem imported from ``tree``, checked first: a child
    that silently imported another copy would time the wrong code."""
    setup = IMPORT_FROM_TREE.format(tree=str(tree))
    found = subprocess.run(
        [sys.executable, "-c", setup + "import tandem; print(tandem.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"a child meant to import tandem from {tree} imports it from {found}")
    into.write_text(
        setup
        + f"import runpy\nsys.argv[0] = {str(script)!r}\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    return into


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(Path(name).stem, Path(__file__).parent / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="the earlier revision (a commit, tag or branch)")
    parser.add_argument("--script", default="grpo_step.py", help="a bench/ script with a tandem child run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        base_tree, root = Path(tmp) / "base", Path(tmp) / "inputs"
        base_tree.mkdir()
        root.mkdir()
        commit = export_revision(args.base, base_tree)
        sides = {
            f"base {commit}": child_script(
                base_tree, base_tree / "bench" / args.script, Path(tmp) / "base.py"
            ),
            "working tree": child_script(REPO, REPO / "bench" / args.script, Path(tmp) / "current.py"),
        }
        load_script(args.script).prepare(root)
        print(describe_machine())
        times: dict[str, list[float]] = {label: [] for label in sides}
        for round_ in range(args.rounds):
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
            for label in order:
                measured = run_side(str(sides[label]), "tandem", root, args.steps, args.warmup)
                times[label] += measured["step"]
                print(round_line(round_, label, measured))
        medians = {label: statistics.median(steps) for label, steps in times.items()}
        for label, median in medians.items():
            print(f"{label}: median {median:.3f} s/step over {len(times[label])} steps")
        base, current = medians.values()
        print(f"working tree / base: {current / base:.3f}x the seconds per step ({args.script})")


if __name__ == "__main__":
    main()
