"""The demos' settings: one base holds the sizes every demo shares and checks them once; each
demo keeps its README defaults, and a bad value is refused when the settings are built, naming
``<class>.<field>``."""

import dataclasses

import pytest

from tandem.demos.arithmetic import DemoSettings
from tandem.demos.distill import DistillDemoSettings
from tandem.demos.preference import DPODemoSettings
from tandem.demos.settings import DemoRunSettings
from tandem.demos.tool_agent import ToolDemoSettings
from tandem.demos.vlm import VLMDemoSettings

SHARED = {  # the arithmetic demo's sizes, as its class declared them before the base
    "output_dir": "outputs/demo", "sft_steps": 600, "sft_batch_size": 128, "sft_lr": 1e-3,
    "rl_steps": 60, "prompts_per_step": 64, "responses_per_prompt": 8, "rl_lr": 3e-4,
    "val_prompts": 256, "val_every": 10, "seed": 0,
}  # fmt: skip
DEFAULTS = {  # every class's defaults as they were written out before the base
    DemoSettings: {
        **SHARED, "mini_batch_prompts": 64, "teacher_error_rate": 0.8, "pipeline": "sync",
        "sft_model_dir": "", "preset": "grpo", "overrides": (),
    },
    ToolDemoSettings: {
        **SHARED, "sft_steps": 300, "sft_batch_size": 64, "rl_steps": 10, "prompts_per_step": 32,
        "val_prompts": 128, "val_every": 5, "tool_rate": 0.3, "pipeline": "sync",
    },
    VLMDemoSettings: {
        **SHARED, "output_dir": "outputs/demo-vlm", "sft_rows": 6000, "train_rows": 4000,
        "sft_steps": 300, "sft_batch_size": 64, "sft_lr": 2e-3, "rl_steps": 30, "prompts_per_step": 32,
        "mini_batch_prompts": 32, "rl_lr": 1e-3, "val_prompts": 128, "val_every": 5,
        "teacher_error_rate": 0.8, "sft_model_dir": "", "overrides": (),
    },
}  # fmt: skip


@pytest.mark.parametrize("cls", list(DEFAULTS), ids=lambda cls: cls.__name__)
def test_each_demo_keeps_its_defaults_on_the_shared_base(cls):
    settings = cls()
    assert isinstance(settings, DemoRunSettings)
    assert dataclasses.asdict(settings) == DEFAULTS[cls]


def test_the_dpo_and_distillation_demos_reuse_the_main_demos_settings():
    assert DPODemoSettings().warm_up == DemoSettings()
    assert DistillDemoSettings().runs == DemoSettings(rl_steps=40, val_every=4)


BAD = [
    # the shared sizes, checked by the base in every demo's class
    (DemoSettings, {"rl_steps": 0}, "DemoSettings.rl_steps must be a positive integer, got 0"),
    (ToolDemoSettings, {"sft_batch_size": 2.5}, "ToolDemoSettings.sft_batch_size must be a positive integer"),
    (VLMDemoSettings, {"rl_lr": -1e-3}, "VLMDemoSettings.rl_lr=-0.001 is outside the allowed range"),
    (DemoSettings, {"sft_lr": float("nan")}, "DemoSettings.sft_lr"),
    (ToolDemoSettings, {"seed": -1}, "ToolDemoSettings.seed must be a non-negative integer"),
    (VLMDemoSettings, {"output_dir": ""}, "VLMDemoSettings.output_dir must name a directory"),
    (DemoSettings, {"val_every": True}, "DemoSettings.val_every must be a positive integer, got True"),
    # each demo's own
    (DemoSettings, {"pipeline": "async"}, "DemoSettings.pipeline='async' is not allowed"),
    (DemoSettings, {"preset": "dapo"}, "DemoSettings.preset='dapo' is not allowed"),
    (
        DemoSettings,
        {"prompts_per_step": 48, "mini_batch_prompts": 32},
        "DemoSettings.mini_batch_prompts=32 must divide DemoSettings.prompts_per_step=48",
    ),
    (DemoSettings, {"teacher_error_rate": 1.5}, "DemoSettings.teacher_error_rate=1.5 is outside"),
    (ToolDemoSettings, {"tool_rate": -0.1}, "ToolDemoSettings.tool_rate=-0.1 is outside"),
    (ToolDemoSettings, {"pipeline": "one-step-off"}, "ToolDemoSettings.pipeline='one-step-off'"),
    (VLMDemoSettings, {"train_rows": 0}, "VLMDemoSettings.train_rows must be a positive integer"),
    (VLMDemoSettings, {"mini_batch_prompts": 64}, "VLMDemoSettings.mini_batch_prompts=64 must divide"),
    (DPODemoSettings, {"pairs_per_step": 0}, "DPODemoSettings.pairs_per_step must be a positive integer"),
    (DPODemoSettings, {"beta": 0.0}, "DPODemoSettings.beta=0.0 is outside"),
    (DPODemoSettings, {"rpo_alpha": -1.0}, "DPODemoSettings.rpo_alpha=-1.0 is outside"),
    (DistillDemoSettings, {"target": 2.0}, "DistillDemoSettings.target=2.0 is outside"),
]


@pytest.mark.parametrize(
    ("cls", "changes", "message"), BAD, ids=[f"{cls.__name__}.{next(iter(c))}" for cls, c, _ in BAD]
)
def test_a_bad_setting_is_refused_naming_its_class_and_field(cls, changes, message):
    with pytest.raises(ValueError) as raised:
        cls(**changes)
    assert message in str(raised.value)
