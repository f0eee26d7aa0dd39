"""Relative paths in a run's config become absolute where the run starts (Ray workers may run
in another directory), while names that are not files here (a Hub model id) stay as given."""

import os

import pytest

from tandem.config.paths import with_absolute_paths
from tandem.controller.group import WorkerGroup
from tandem.rl import RLTrainer
from tandem.rl.config_loader import load_train_config
from tandem.rl.trainer import PATH_INPUTS, PATH_OUTPUTS
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
    resolved = with_absolute_paths(config, PATH_OUTPUTS, PATH_INPUTS)
    assert resolved.model_path == str(tmp_path / "models" / "policy")
    assert resolved.critic.model_path == "Qwen/Qwen2.5-0.5B"
    assert resolved.data.train_path == str(tmp_path / "train.jsonl")
    assert resolved.reward.custom_path == str(tmp_path / "reward.py")
    assert resolved.trainer.output_dir == str(tmp_path / "runs" / "a")
    assert resolved.trainer.profile_dir == "" and resolved.data.val_path == ""
    assert (
        with_absolute_paths(resolved, PATH_OUTPUTS, PATH_INPUTS) == resolved
    )  # absolute paths stay as they are
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
    resolved = with_absolute_paths(config, PATH_OUTPUTS, PATH_INPUTS)
    assert resolved.model_path == resolved.actor.engine.model_path == str(tmp_path / "m")
