"""PPO with a critic trains the demo task from its SFT warm-up to at least 90% held-out accuracy,
in the sync loop and fully async (the whole demo, about two minutes on 2 CPU cores each: the
slow tier, ``pytest -m slow``)."""

import pytest

from tandem.demos.accuracy import ACCURACY_KEY
from tandem.demos.arithmetic import DemoSettings, run_demo


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["sync", "fully_async"])
def test_ppo_demo_reaches_ninety_percent(tmp_path, pipeline):
    result = run_demo(DemoSettings(output_dir=str(tmp_path), preset="ppo", pipeline=pipeline))
    curve = [r[ACCURACY_KEY] for r in result.history if ACCURACY_KEY in r]
    assert curve[0] < 0.2  # the warm-up copies the teacher's slip
    assert curve[-1] >= 0.9, curve
    assert any("critic/vf_loss" in r for r in result.history)
