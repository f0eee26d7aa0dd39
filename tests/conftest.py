"""Fixtures shared across test packages: a real local Ray cluster, a tiny model with arithmetic prompts."""

import compileall
import os
import sys
from pathlib import Path

import pytest

from tandem.data import write_parquet
from tandem.dataplane.shm import PREFIX as BLOCK_PREFIX
from tandem.models import save_tiny_model
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows

ROOT = str(Path(__file__).resolve().parents[1])


def pytest_configure(config):
    """With ``PYTHONDONTWRITEBYTECODE`` set (as on the CI host) no process writes bytecode, so each
    of the hundreds the suite starts (spawned ranks, Ray workers, CLI runs) would compile tandem
    afresh (~0.3 s each). Compiled once here into the usual ``__pycache__`` folders (git-ignored),
    which those processes read; an edited source is recompiled as usual (mtime and size checked)."""
    if sys.dont_write_bytecode:
        compileall.compile_dir(Path(ROOT) / "tandem", quiet=2)  # a broken file fails when imported


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(
        num_cpus=8,  # over-subscribe the 2-core CI machine: tests hold several small groups at once
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": ROOT}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def _no_block_files_left_in_this_process():
    """A test leaves no data-plane block file of this process in /dev/shm (in-process workers' blocks
    are this process's: no worker shutdown deletes them, so a step that fails must release its own)."""
    pattern = f"{BLOCK_PREFIX}-{os.getpid()}-*"
    before = {path.name for path in Path("/dev/shm").glob(pattern)}
    yield
    left = sorted(path.name for path in Path("/dev/shm").glob(pattern) if path.name not in before)
    for name in left:  # the next test starts clean
        (Path("/dev/shm") / name).unlink(missing_ok=True)
    assert not left, f"the test left {len(left)} data-plane block file(s) in /dev/shm: {left[:3]}"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped, with the reason, on machines without it."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (the gpu tier)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def rl_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    task = ArithmeticTaskConfig(max_digits=2)
    reward = root / "digit_share.py"
    reward.write_text(  # a random tiny model never solves arithmetic: reward something it does by chance
        "def compute_score(data_source, solution, ground_truth, extra_info):\n"
        "    return sum(c.isdigit() for c in solution) / max(len(solution), 1)\n"
    )
    return {
        "reward": str(reward),
        "model": str(save_tiny_model(root / "model")),
        "train": str(write_parquet(arithmetic_rows(64, task, seed=0), root / "train.parquet")),
        "val": str(write_parquet(arithmetic_rows(12, task, seed=1, split="test"), root / "val.parquet")),
    }
