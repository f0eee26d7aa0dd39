"""Two real RL runs for the report tests: the same small GRPO config at two learning rates,
the first snapshotted mid-run (``status.json`` and ``report.html`` as a user would see them live)."""

import shutil

import pytest

from tandem.rl import RLTrainer
from tests.rl.conftest import small_config


def _run(rl_files, output_dir, *overrides, snapshot_before_step=None, snapshot_dir=None):
    trainer = RLTrainer(
        small_config(
            rl_files,
            output_dir,
            "trainer.total_steps=4",
            "trainer.val_every=2",
            "trainer.report_every=1",
            *overrides,
        )
    )
    original = trainer.train_step

    def train_step():
        if trainer.step + 1 == snapshot_before_step:  # the live files, as left after the previous step
            snapshot_dir.mkdir(parents=True)
            for name in ("status.json", "report.html", "run.json"):
                shutil.copy(output_dir / name, snapshot_dir / name)
        return original()

    trainer.train_step = train_step
    return trainer.fit()


@pytest.fixture(scope="session")
def report_runs(rl_files, tmp_path_factory):
    """``{"fast": dir, "slow": dir, "live": snapshot dir of "fast" before its step 3}``."""
    root = tmp_path_factory.mktemp("report_runs")
    # the rollout/trainer mismatch panel needs rollout log-probs to compare: the default logs them
    _run(
        rl_files,
        root / "fast",
        "trainer.experiment=lr_1e-3",
        snapshot_before_step=3,
        snapshot_dir=root / "live",
    )
    _run(rl_files, root / "slow", "trainer.experiment=lr_1e-4", "actor.engine.lr=1e-4")
    return {"fast": root / "fast", "slow": root / "slow", "live": root / "live"}
