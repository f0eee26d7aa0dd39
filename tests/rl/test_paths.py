"""Relative paths in a run's config become absolute where the run starts (Ray workers may run
in another directory), while names that are not files here (a Hub model id) stay as given."""

import dataclasses
import os
import typing

import pytest

from tandem.config.paths import MODEL_PATH, model_path_keys, path_kind, with_absolute_paths
from tandem.controller.group import WorkerGroup
from tandem.dpo import PreferenceDataConfig
from tandem.dpo.config import DPOConfig
from tandem.rl import RLTrainer
from tandem.rl.config import TrainConfig
from tandem.rl.config_loader import load_train_config
from tandem.rm.config import RewardModelConfig
from tandem.sft import SFTDataConfig
from tandem.sft.config import SFTConfig
from tests.rl.conftest import small_config


def test_relative_paths_resolve_against_the_drivers_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "policy").mkdir(parents=True)
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "reward.py").write_text("")
    config = load_train_config(
        [
            "model_path=models/policy",
            "critic.model_path=Qwen/Qwen2.5-0.5B",  # not here: a Hub id, left alone
            "data.train_path=train.jsonl",
            "reward.custom_path=./reward.py",
            "trainer.output_dir=runs/a",  # does not exist yet: outputs resolve anyway
            "trainer.profile_dir=",
        ]
    )
    resolved = with_absolute_paths(config)
    assert resolved.model_path == str(tmp_path / "models" / "policy")
    assert resolved.critic.model_path == "Qwen/Qwen2.5-0.5B"
    assert resolved.data.train_path == str(tmp_path / "train.jsonl")
    assert resolved.reward.custom_path == str(tmp_path / "reward.py")
    assert resolved.trainer.output_dir == str(tmp_path / "runs" / "a")
    assert resolved.trainer.profile_dir == "" and resolved.data.val_path == ""
    assert with_absolute_paths(resolved) == resolved  # absolute paths stay as they are
    assert all(os.path.isabs(p) for p in (resolved.model_path, resolved.trainer.output_dir))


def test_workers_that_cannot_read_the_output_dir_are_refused_before_loading(rl_files, tmp_path, monkeypatch):
    """As if a worker ran on a machine without the output directory's filesystem."""
    monkeypatch.setattr(WorkerGroup, "ranks_seeing", lambda self, directory: set())
    trainer = RLTrainer(small_config(rl_files, tmp_path / "run"))
    with pytest.raises(ValueError, match=r"trainer.output_dir=.*run: worker rank 0 cannot read files"):
        trainer.fit()


def test_a_key_that_must_equal_another_still_does_once_both_resolve(tmp_path, monkeypatch):
    """``actor.engine.model_path`` may repeat ``model_path`` (it follows it): both resolve together."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    config = load_train_config(["model_path=m", "actor.engine.model_path=m", "data.train_path=t.parquet"])
    resolved = with_absolute_paths(config)
    assert resolved.model_path == resolved.actor.engine.model_path == str(tmp_path / "m")


PATH_NAMES = ("path", "directory")  # a field named so, or ending in _path or _dir, holds a path
CONFIGS = {
    "tandem train": TrainConfig,
    "tandem sft": SFTConfig,
    "tandem dpo": DPOConfig,
    "tandem rm": RewardModelConfig,
}


def _unmarked_path_fields(config_class: type, prefix: str = "") -> list[str]:
    """Dotted keys of fields below ``config_class`` that are named like paths but not marked."""
    unmarked = []
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        key = f"{prefix}{field.name}"
        kind = hints[field.name]
        if dataclasses.is_dataclass(kind):
            unmarked += _unmarked_path_fields(kind, f"{key}.")
        elif (field.name in PATH_NAMES or field.name.endswith(("_path", "_dir"))) and path_kind(
            field
        ) is None:
            unmarked.append(key)
    return unmarked


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_every_path_valued_key_is_marked_on_its_field(command):
    """``teacher.model_path`` was missing from a list of keys kept beside the configs: the
    fields carry the mark now, and a field named like a path without one fails here."""
    assert _unmarked_path_fields(CONFIGS[command]) == []


def test_a_relative_teacher_path_resolves_with_the_others(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "teacher").mkdir()
    config = load_train_config(
        ["model_path=m", "data.train_path=t.parquet", "teacher.model_path=teacher",
         "algorithm.distill.objective=reverse_kl"]
    )  # fmt: skip
    resolved = with_absolute_paths(config)
    assert resolved.teacher.model_path == str(tmp_path / "teacher")
    assert resolved.model_path == "m"  # not here: left as written (a Hub id)


def _model_fields_without_the_mark(config_class: type, prefix: str = "") -> list[str]:
    """Dotted keys below ``config_class`` that name a model (a field named ``*model_path``, or
    ``reward.model.path``) but are not marked :data:`MODEL_PATH`."""
    unmarked = []
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        key = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(hints[field.name]):
            unmarked += _model_fields_without_the_mark(hints[field.name], f"{key}.")
        elif (field.name.endswith("model_path") or key == "reward.model.path") and path_kind(field) != MODEL_PATH:
            unmarked.append(key)
    return unmarked


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_every_model_path_is_marked_as_a_model(command):
    """A GGUF file is converted for the fields marked :data:`MODEL_PATH` only: a model field
    without the mark would reach the workers as a ``.gguf`` file."""
    assert _model_fields_without_the_mark(CONFIGS[command]) == []


# the lists the trainers kept by hand before the marks (tandem/rl/trainer.py, tandem/sft/trainer.py)
RL_MODEL_PATHS = (
    "model_path", "actor.engine.model_path", "critic.model_path", "critic.engine.model_path",
    "reward.model.path", "teacher.model_path",
)  # fmt: skip
SFT_MODEL_PATHS = ("model_path", "engine.model_path", "ref_model_path")  # ref_model_path: DPO's


def test_the_marked_model_keys_are_the_lists_the_trainers_kept():
    """Walked from the marks, each trainer's model keys are its old hand-kept list (the SFT list's
    keys that SFT lacks skipped, as before), plus ``teacher.engine.model_path``: it is an
    :class:`~tandem.engine.config.EngineConfig` field like ``actor.engine.model_path``, which the
    RL list already had."""
    rl = load_train_config(["model_path=m", "data.train_path=t.parquet"])
    assert sorted(model_path_keys(rl)) == sorted((*RL_MODEL_PATHS, "teacher.engine.model_path"))
    sft = SFTConfig(model_path="m", data=SFTDataConfig(train_path="t.jsonl"))
    assert model_path_keys(sft) == SFT_MODEL_PATHS[:2]
    pairs = PreferenceDataConfig(train_path="t.jsonl")
    assert model_path_keys(DPOConfig(model_path="m", data=pairs)) == SFT_MODEL_PATHS
    assert model_path_keys(RewardModelConfig(model_path="m", data=pairs)) == SFT_MODEL_PATHS
