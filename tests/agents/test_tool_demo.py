"""The tool demo trains: after an SFT warm-up on a teacher that mostly guesses, GRPO with the
``tool_agent`` loop teaches a tiny model to multiply 3-digit numbers with the calculator
(a short run: about 90 s on 2 CPU cores)."""

import pytest

from tandem.demos.accuracy import ACCURACY_KEY
from tandem.demos.tool_agent import ToolDemoSettings, run_tool_demo


@pytest.mark.slow  # a whole demo run (minutes); agent episodes in RL runs are tested in test_rl_agents.py
def test_grpo_with_the_calculator_raises_held_out_accuracy(tmp_path):
    settings = ToolDemoSettings(output_dir=str(tmp_path), rl_steps=5, val_prompts=64, val_every=5)
    result = run_tool_demo(settings)
    curve = [r[ACCURACY_KEY] for r in result.history if ACCURACY_KEY in r]
    assert curve[0] < 0.3 and curve[-1] >= curve[0] + 0.4, curve  # measured: 0.16 -> 0.77
    calls = [r["agent/tool_calls/mean"] for r in result.history if "agent/tool_calls/mean" in r]
    assert calls[-1] > 2 * calls[0], calls  # the policy learnt to call the tool
    episodes = settings.prompts_per_step * settings.responses_per_prompt
    for r in result.history:  # the tools ran no more calls than the step's own episodes made
        if (
            "agent/tool_calls/mean" in r
        ):  # (validation's are not counted; a call to an unknown tool is not run)
            ran = sum(v for k, v in r.items() if k.startswith("agent/tool/") and k.endswith("/calls"))
            made = r["agent/tool_calls/mean"] * episodes
            assert 0.9 * made <= ran <= made + 1e-6
    # sampler == trainer on the model's tokens, up to fp32 rounding over ~190-token episodes
    # (measured: max |diff| 1e-5 to 3e-5 per step, mean KL about 1e-9)
    assert all(r["rollout_corr/max_abs_log_prob_diff"] <= 1e-4 for r in result.history if r["step"] > 0)
