"""A shrunk ``tandem demo --method vlm``: held-out accuracy rises, and the same model with its
pictures blanked does not get there (it must read the picture)."""

from __future__ import annotations

import pytest

from tandem.demos.accuracy import accuracy_curve
from tandem.demos.vlm import ACCURACY_KEY, VLMDemoSettings, run_vlm_demo
from tandem.run.trackers import read_jsonl


@pytest.mark.slow  # a whole demo run; VLM GRPO with exact log-probs is tested in test_vlm_grpo.py
def test_a_shrunk_vlm_demo_learns_from_the_pictures(tmp_path):
    settings = VLMDemoSettings(
        output_dir=str(tmp_path), sft_rows=3000, train_rows=300, sft_steps=150, sft_batch_size=32,
        rl_steps=6, prompts_per_step=16, mini_batch_prompts=16, val_prompts=48, val_every=3,
    )  # fmt: skip
    result, control = run_vlm_demo(settings)
    curve = accuracy_curve(result, ACCURACY_KEY)
    assert [step for step, _ in curve] == [0, 3, 6]
    first, last = curve[0][1], max(value for _, value in curve[1:])
    assert last >= first + 0.15, curve
    assert control <= 0.4 and control < last, (control, curve)  # blank pictures: near chance (25%) or below
    samples = read_jsonl(tmp_path / "grpo" / "val_samples.jsonl")
    assert all(s["images"][0].startswith("data:image/png;base64,") for s in samples)
