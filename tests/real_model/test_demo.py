"""The real-model demo (``tandem demo --model smollm2``): its settings, a shrunk run whose
before-accuracy equals an independent HF ``generate`` evaluation of the same held-out prompts,
and the full demo in the slow tier."""

import pytest
import torch

from tandem.cli import main
from tandem.data import read_rows
from tandem.demos.accuracy import accuracy_curve
from tandem.demos.real_model import (
    ACCURACY_KEY,
    RealModelDemoSettings,
    real_model_overrides,
    run_real_model_demo,
    update_precision,
)
from tandem.device import cpu_bf16_instructions
from tandem.rl.rewards.scorers import gsm8k_score
from tests.real_model.conftest import chat_prompt


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("model", "gpt2", "RealModelDemoSettings.model"),
        ("precision", "fp16", "RealModelDemoSettings.precision"),
        ("response_length", 0, "RealModelDemoSettings.response_length"),
        ("mini_batch_prompts", 3, "RealModelDemoSettings.mini_batch_prompts=3 must divide"),
        ("rl_steps", -1, "RealModelDemoSettings.rl_steps"),
    ],
)
def test_the_settings_refuse_a_bad_value_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        RealModelDemoSettings(**{field: value})


@pytest.mark.parametrize("precision", ["auto", "bf16", "fp32"])
def test_the_update_precision_is_bf16_only_where_the_cpu_multiplies_it(precision, monkeypatch, tmp_path):
    """``auto`` (the default) is bf16 on a CPU with AVX-512 BF16 or AMX and fp32 elsewhere, so the
    demo runs on every CPU (bf16 would be refused on one without them); the explicit choices pass."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the demo's device: this CPU
    settings = RealModelDemoSettings(precision=precision)
    expected = {"auto": "bf16" if cpu_bf16_instructions() else "fp32"}.get(precision, precision)
    assert update_precision(settings) == expected
    overrides = real_model_overrides(settings, "model", {"train": tmp_path / "t", "val": tmp_path / "v"})
    assert f"actor.engine.mixed_precision={'bf16' if expected == 'bf16' else 'none'}" in overrides


def test_the_real_model_goes_with_grpo_only(tmp_path, capsys):
    assert main(["demo", "--model", "smollm2", "--method", "ppo", "--output-dir", str(tmp_path)]) == 2
    assert "--model smollm2 runs with --method grpo only, not --method ppo" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any work


def hf_greedy_accuracy(model, tokenizer, rows, max_new_tokens: int) -> float:
    """Share of ``rows`` whose greedy HF ``generate`` response (chat template, one prompt at a time,
    ending at EOS) the demo's scorer counts right: the reference for the demo's step-0 accuracy."""
    right = 0
    for row in rows:
        prompt = chat_prompt(tokenizer, row["prompt"][0]["content"])
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        text = tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)
        right += gsm8k_score(text, row["reward_model"]["ground_truth"], {})
    return right / len(rows)


@pytest.mark.slow  # ~1-2.5 min on 2 cores: past the real-model tier's budget; the settings and CLI tests stay
def test_a_shrunk_demo_measures_the_base_model_and_writes_the_report(
    smollm2_dir, smollm2_model, smollm2_tokenizer, tmp_path
):
    settings = RealModelDemoSettings(
        output_dir=str(tmp_path), rl_steps=1, prompts_per_step=4, responses_per_prompt=2, mini_batch_prompts=4,
        val_prompts=6, val_every=1, response_length=12,
    )  # fmt: skip
    result = run_real_model_demo(settings)
    (_, before), (after_step, after) = accuracy_curve(result, ACCURACY_KEY)
    val_rows = read_rows(tmp_path / "data" / "val.parquet")
    assert len(val_rows) == 6 and after_step == 1 and 0.0 <= after <= 1.0
    assert before == pytest.approx(hf_greedy_accuracy(smollm2_model, smollm2_tokenizer, val_rows, 12))
    assert result.report is not None and result.report.is_file()
    assert result.hf_model_dir is not None and (result.hf_model_dir / "config.json").is_file()


@pytest.mark.slow
def test_the_full_demo_lifts_held_out_accuracy(tmp_path):
    result = run_real_model_demo(RealModelDemoSettings(output_dir=str(tmp_path)))
    curve = accuracy_curve(result, ACCURACY_KEY)
    assert curve[-1][1] >= curve[0][1] + 0.10, curve
