"""The teacher's ranks report each row once: two data-parallel ranks, and two tensor-parallel ranks
(``teacher.engine.tp_size=2``), score a batch as one process does (:mod:`tandem.engine.on_rank`
decides which rank of a group reports)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.controller import create_worker_group
from tandem.models import TinyModelConfig, load_tokenizer, save_tiny_model
from tandem.protocol import Batch
from tandem.rl.teacher_worker import TeacherWorker, check_restrictable, shared_vocabulary
from tests.rl.conftest import small_config
from tests.rl.test_distill import padded_batch

PAIRS = [("12+7=", "19"), ("3+45=", "48<|im_end|>"), ("12+7=", "20 and more"), ("99+1=", "1")]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another tiny model with the policy's tokenizer and head size."""
    return str(save_tiny_model(tmp_path_factory.mktemp("teacher"), TinyModelConfig(seed=7)))


def scored_batch(tokenizer) -> Batch:
    """``PAIRS`` with prompts left-padded and responses right-padded, as generation returns them."""
    return padded_batch(tokenizer, PAIRS)


def teacher_log_probs(rl_files, output_dir, teacher, *overrides) -> torch.Tensor:
    config = small_config(
        rl_files, output_dir, f"teacher.model_path={teacher}", "algorithm.distill.objective=reverse_kl",
        *overrides,
    )  # fmt: skip
    batch = scored_batch(load_tokenizer(teacher))
    with create_worker_group(TeacherWorker, config.teacher_resource_pool(), "local", args=(config,)) as group:
        group.init_model()
        return group.compute_teacher_log_prob(batch)["teacher_log_probs"]


@pytest.mark.parametrize(
    "two_ranks",
    [
        ("trainer.n_workers=2",),  # ~9.5 s each on 2 shared cores (75 s when 8 jobs share them)
        ("trainer.n_workers=2", "teacher.engine.tp_size=2"),
    ],
    ids=["data-parallel", "tensor-parallel"],
)
def test_two_teacher_ranks_score_each_row_once_as_one_process(rl_files, teacher_dir, tmp_path, two_ranks):
    """Each row comes back once, in order, with the one process's log-probs (fp32: 1e-5; a
    tensor-parallel head sums its vocabulary shards' softmax terms in another order)."""
    one = teacher_log_probs(rl_files, tmp_path / "one", teacher_dir)
    two = teacher_log_probs(rl_files, tmp_path / "two", teacher_dir, *two_ranks)
    assert two.shape == one.shape == (len(PAIRS), one.shape[1])
    torch.testing.assert_close(two, one, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("teacher.engine.tp_size=3",), "teacher.engine.tp_size=3 must divide the 2 workers"),
        (
            ("teacher.engine.tp_size=2", "teacher.top_k=4"),
            "teacher.top_k=4 with teacher.engine.tp_size=2: the teacher's top-k tokens are not computed",
        ),
    ],
)
def test_a_teacher_layout_that_cannot_run_names_the_key(rl_files, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(
            rl_files, tmp_path, "trainer.n_workers=2", "teacher.model_path=/x",
            "algorithm.distill.objective=reverse_kl", *overrides,
        )  # fmt: skip


def test_a_tensor_parallel_teacher_passes_the_config_rules(rl_files, tmp_path):
    config = small_config(
        rl_files, tmp_path, "trainer.n_workers=2", "teacher.model_path=/x",
        "algorithm.distill.objective=reverse_kl", "teacher.engine.tp_size=2",
    )  # fmt: skip
    assert config.teacher.engine.tp_size == 2


def test_a_tensor_parallel_teacher_padded_past_the_students_vocabulary_is_refused_naming_the_keys(
    rl_files, tmp_path
):
    """A head split over tensor-parallel ranks cannot be cut to the ids the two models share; the
    refusal reads the configs only (``config.json``), before a padded head would be split."""
    padded = json.loads((Path(rl_files["model"]) / "config.json").read_text())
    padded["vocab_size"] += 16
    (tmp_path / "padded").mkdir()
    (tmp_path / "padded" / "config.json").write_text(json.dumps(padded))
    overrides = [
        "trainer.n_workers=2", f"teacher.model_path={tmp_path / 'padded'}",
        "algorithm.distill.objective=reverse_kl",
    ]  # fmt: skip
    unsplit = small_config(rl_files, tmp_path, *overrides)
    check_restrictable(unsplit, shared_vocabulary(unsplit))  # one rank's head is cut as before
    split = small_config(rl_files, tmp_path, *overrides, "teacher.engine.tp_size=2")
    with pytest.raises(
        ValueError, match=r"teacher.engine.tp_size=2 with teacher.model_path=.*set teacher.engine.tp_size=1"
    ):
        check_restrictable(split, shared_vocabulary(split))
