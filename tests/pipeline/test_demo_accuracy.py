"""The asynchronous pipelines learn the demo task as well as the synchronous loop does (>= 90%)."""

from pathlib import Path

import pytest

from tandem.demos.arithmetic import ACCURACY_KEY, DemoSettings, run_demo

# whole demo runs (minutes each): the asynchronous modes train like sync step for step in
# tests/pipeline/test_async_training.py; these accuracy runs are in the slow tier
pytestmark = pytest.mark.slow


def _final_accuracy(result) -> float:
    return [r[ACCURACY_KEY] for r in result.history if ACCURACY_KEY in r][-1]


@pytest.fixture(scope="module")
def fully_async(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-fully-async")
    return root, run_demo(DemoSettings(output_dir=str(root), pipeline="fully_async", val_every=30))


def test_fully_async_trains_the_demo_to_90_percent(fully_async):
    _, result = fully_async
    staleness = [r["pipeline/staleness/max"] for r in result.history if "pipeline/staleness/max" in r]
    assert len(staleness) == 60 and max(staleness) <= 1  # the default threshold
    assert _final_accuracy(result) >= 0.9


def test_one_step_off_trains_the_demo_to_90_percent(fully_async, tmp_path):
    root, _ = fully_async
    settings = DemoSettings(
        output_dir=str(tmp_path), pipeline="one_step_off", val_every=30,
        sft_model_dir=str(Path(root) / "sft" / "hf_model"),  # the same warm-up
    )  # fmt: skip
    result = run_demo(settings)
    assert _final_accuracy(result) >= 0.9
