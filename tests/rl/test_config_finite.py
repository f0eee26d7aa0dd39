"""``tandem train`` (and ``sft``) refuse a NaN or inf setting by the key as written, before
anything loads; a field documented as "``inf``: no limit" takes ``inf`` (issue 54)."""

import math

import pytest

from tandem.cli import main
from tandem.rl import load_train_config

# Paths that do not exist: a run that got past the config would fail on them, saying something else.
MISSING = ["preset=grpo", "model_path=/no/such/model", "data.train_path=/no/such/train.parquet"]


@pytest.mark.parametrize(
    "setting",
    [
        "actor.engine.lr=nan",
        "actor.engine.weight_decay=nan",
        "actor.policy_loss.clip_ratio_low=nan",
        "rollout.top_p=nan",
        "algorithm.gamma=nan",
        "actor.policy_loss.clip_ratio_c=nan",
        "rollout.temperature=inf",
        "critic.engine.lr=-inf",
    ],
)
def test_tandem_train_refuses_a_non_finite_setting_naming_its_key(setting, capsys):
    assert main(["train", *MISSING, setting]) == 2
    assert capsys.readouterr().err == (
        f"tandem train: error: {setting} is not allowed: it must be a finite number\n"
    )


def test_tandem_sft_refuses_nan_from_its_yaml_naming_the_key(tmp_path, capsys):
    yaml = tmp_path / "sft.yaml"
    yaml.write_text("engine:\n  lr: .nan\n")
    assert main(["sft", "--config", str(yaml), "model_path=/no/such/model"]) == 2
    assert (
        capsys.readouterr().err
        == "tandem sft: error: engine.lr=nan is not allowed: it must be a finite number\n"
    )


def test_inf_where_it_is_documented_as_no_limit_still_works():
    config = load_train_config(
        [
            *MISSING,
            "algorithm.rollout_correction.is_level=token",
            "algorithm.rollout_correction.is_threshold=inf",
            "algorithm.rollout_correction.rejection=token",
            "algorithm.rollout_correction.rejection_high=inf",
        ]
    )
    correction = config.algorithm.rollout_correction
    assert correction.is_threshold == math.inf and correction.rejection_high == math.inf
    with pytest.raises(
        ValueError,
        match=r"^algorithm.rollout_correction.rejection_high=nan is not allowed: "
        r"it must be a number or inf \(no limit\)$",
    ):
        load_train_config([*MISSING, "algorithm.rollout_correction.rejection_high=nan"])
