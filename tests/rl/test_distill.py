"""On-policy distillation: the teacher role scores sampled tokens as the teacher model's own
forward does, colocated and in its own pool alike, and distilling lowers the reverse KL."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tandem.algos.distill import distill_metrics, reverse_kl_advantages, top_k_jsd
from tandem.controller import create_worker_group
from tandem.controller.errors import WorkerError
from tandem.data import write_parquet
from tandem.data.rows import read_rows
from tandem.demos.accuracy import accuracy_curve
from tandem.demos.arithmetic import DemoSettings
from tandem.demos.distill import DistillDemoSettings, first_step_reaching, run_distill_demo
from tandem.models import TinyModelConfig, load_model, load_tokenizer, save_tiny_model
from tandem.protocol import Batch
from tandem.rl import RLTrainer
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows
from tandem.rl.dataset_responses import is_off_policy_step
from tandem.rl.teacher_worker import TeacherWorker
from tests.rl.conftest import small_config


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another tiny model with the policy's tokenizer, its head scaled up: a peaked distribution
    far (in reverse KL) from the random policy's near-uniform one."""
    path = save_tiny_model(tmp_path_factory.mktemp("teacher"), TinyModelConfig(seed=7))
    model = load_model(path)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path)
    return str(path)


def distill_config(rl_files, output_dir, teacher, *overrides):
    return small_config(
        rl_files, output_dir,
        f"teacher.model_path={teacher}", "algorithm.distill.objective=reverse_kl", *overrides,
    )  # fmt: skip


def padded_batch(tokenizer, pairs: list[tuple[str, str]]) -> Batch:
    """Prompts left-padded and responses right-padded, as generation returns them."""
    pad = tokenizer.pad_token_id
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in pairs]
    responses = [tokenizer(r, add_special_tokens=False)["input_ids"] for _, r in pairs]
    width, length = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    response_ids = torch.tensor([r + [pad] * (length - len(r)) for r in responses])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    response_mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in responses])
    return Batch(
        {
            "prompts": prompt_ids,
            "responses": response_ids,
            "input_ids": torch.cat([prompt_ids, response_ids], 1),
            "attention_mask": torch.cat([prompt_mask, response_mask], 1),
            "response_mask": response_mask,
        }
    )


def test_the_teacher_role_returns_the_teacher_models_own_log_probs(rl_files, teacher_dir, tmp_path):
    config = distill_config(rl_files, tmp_path, teacher_dir, "teacher.top_k=4")
    tokenizer = load_tokenizer(teacher_dir)
    pairs = [("12+7=", "19"), ("3+45=", "48<|im_end|>"), ("12+7=", "20 and more"), ("99+1=", "1")]
    batch = padded_batch(tokenizer, pairs)
    with create_worker_group(TeacherWorker, config.teacher_resource_pool(), "local", args=(config,)) as group:
        group.init_model()
        teacher = group.compute_teacher_log_prob(batch)
    scored = teacher["teacher_log_probs"]
    model = load_model(teacher_dir)
    for row, (prompt, response) in enumerate(pairs):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : -1].float()
        full = torch.log_softmax(logits, -1)
        expected = full.gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        torch.testing.assert_close(scored[row, : len(r)], expected, rtol=0, atol=1e-5)
        assert torch.all(scored[row, len(r) :] == 0)  # padding scores nothing
        values, ids = full.topk(4, dim=-1)  # the teacher's 4 likeliest tokens at each position
        assert torch.equal(teacher["teacher_top_ids"][row, : len(r)], ids)
        torch.testing.assert_close(teacher["teacher_top_log_probs"][row, : len(r)], values, rtol=0, atol=1e-5)


def test_distilling_lowers_the_reverse_kl_and_the_teachers_placement_changes_nothing(
    rl_files, teacher_dir, tmp_path
):
    alone = ("algorithm.distill.reward_coef=0", "actor.engine.lr=1e-2")
    colocated = RLTrainer(
        distill_config(rl_files, tmp_path / "colocated", teacher_dir, *alone, "trainer.total_steps=8")
    ).fit()
    separate = RLTrainer(
        distill_config(
            rl_files, tmp_path / "separate", teacher_dir, *alone, "teacher.placement=separate",
            "trainer.total_steps=2",
        )
    ).fit()  # fmt: skip
    steps = [h for h in colocated.history if h["step"] > 0]
    kl = [h["distill/reverse_kl"] for h in steps]
    # the student moves toward the teacher on its own samples (each step's estimate is noisy)
    assert sum(kl[-3:]) / 3 < 0.75 * sum(kl[:2]) / 2, kl
    teacher = [h["distill/teacher_log_prob"] for h in steps]
    assert sum(teacher[-3:]) / 3 > sum(teacher[:2]) / 2, teacher
    for a, b in zip(steps[:2], [h for h in separate.history if h["step"] > 0], strict=True):
        for name in ("distill/reverse_kl", "distill/teacher_log_prob", "actor/pg_loss", "actor/grad_norm"):
            assert a[name] == b[name], name


def test_the_jsd_objective_moves_the_student_toward_the_teachers_top_k(rl_files, teacher_dir, tmp_path):
    result = RLTrainer(
        distill_config(
            rl_files, tmp_path, teacher_dir, "algorithm.distill.objective=jsd", "teacher.top_k=8",
            "algorithm.distill.reward_coef=0", "actor.engine.lr=1e-2", "trainer.total_steps=6",
        )
    ).fit()  # fmt: skip
    steps = [h for h in result.history if h["step"] > 0]
    loss = [h["distill/loss"] for h in steps]
    agreement = [h["distill/greedy_agreement"] for h in steps]
    assert sum(loss[-2:]) / 2 < 0.75 * sum(loss[:2]) / 2, loss
    assert sum(agreement[-2:]) / 2 > sum(agreement[:2]) / 2, agreement
    assert all(0.0 <= a <= 1.0 for a in agreement)
    assert all(h["actor/pg_loss"] == 0.0 for h in steps)  # reward_coef=0: the JSD term alone trains


def test_a_teacher_with_another_tokenizer_is_refused_naming_both_models(rl_files, teacher_dir, tmp_path):
    other = tmp_path / "other_teacher"
    model, tokenizer = load_model(teacher_dir), load_tokenizer(teacher_dir)
    tokenizer.add_tokens(["<extra>"])
    model.save_pretrained(other)
    tokenizer.save_pretrained(other)
    with pytest.raises(ValueError, match="another tokenizer") as error:
        RLTrainer(distill_config(rl_files, tmp_path / "run", str(other)))
    assert str(other) in str(error.value) and rl_files["model"] in str(error.value)


PADDING_ROWS = 50


@pytest.fixture(scope="module")
def padded_teacher_dir(teacher_dir, tmp_path_factory):
    """The teacher with its vocabulary padded from 103 to 153 rows and the same tokenizer: the
    first 103 rows are the teacher's, the padding rows ten times its first 50, so their logits are
    the largest wherever those are positive (as if the padding had been trained upward)."""
    path = tmp_path_factory.mktemp("padded_teacher")
    model = load_model(teacher_dir)
    rows = model.get_output_embeddings().weight.shape[0]
    model.resize_token_embeddings(rows + PADDING_ROWS)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[rows:] = 10.0 * head[:PADDING_ROWS]
    model.save_pretrained(path)
    load_tokenizer(teacher_dir).save_pretrained(path)
    return str(path)


def _teacher_scores(config, batch: Batch) -> Batch:
    with create_worker_group(TeacherWorker, config.teacher_resource_pool(), "local", args=(config,)) as group:
        group.init_model()
        return group.compute_teacher_log_prob(batch)


def test_a_teacher_padded_past_the_students_vocabulary_scores_as_the_unpadded_one(
    rl_files, teacher_dir, padded_teacher_dir, tmp_path
):
    """Its softmax used to include the padding rows (``reverse_kl``), and its top-k tokens ids the
    student does not have (``index 109 is out of bounds``): scored over the shared ids it gives
    the unpadded teacher's numbers exactly, and so the same advantages, divergence and metrics."""
    tokenizer = load_tokenizer(teacher_dir)
    batch = padded_batch(tokenizer, [("12+7=", "19"), ("3+45=", "48<|im_end|>"), ("99+1=", "1 and more")])
    padded_model = load_model(padded_teacher_dir)
    with torch.no_grad():  # the padding matters: it holds most of the padded head's own softmax
        full = torch.softmax(padded_model(batch["input_ids"]).logits.float(), -1)
    assert full[..., -PADDING_ROWS:].sum(-1).mean() > 0.5
    plain, padded = (
        _teacher_scores(distill_config(rl_files, tmp_path, teacher, "teacher.top_k=8"), batch)
        for teacher in (teacher_dir, padded_teacher_dir)
    )
    assert set(padded.keys()) == set(plain.keys())
    for name in plain.keys():
        assert torch.equal(padded[name], plain[name]), name
    student = torch.full_like(plain["teacher_log_probs"], -2.0)  # any student: the same for both teachers
    mask = batch["response_mask"]
    assert torch.equal(
        reverse_kl_advantages(student, padded["teacher_log_probs"], mask),
        reverse_kl_advantages(student, plain["teacher_log_probs"], mask),
    )
    assert distill_metrics(student, padded["teacher_log_probs"], mask) == distill_metrics(
        student, plain["teacher_log_probs"], mask
    )
    student_top = torch.log_softmax(
        torch.randn(*padded["teacher_top_ids"].shape[:2], 103, generator=torch.Generator().manual_seed(0)), -1
    ).gather(
        -1, padded["teacher_top_ids"]
    )  # a student's log-probs of the padded teacher's top-k tokens: ids it has
    assert torch.equal(
        top_k_jsd(student_top, padded["teacher_top_log_probs"], 0.5),
        top_k_jsd(student_top, plain["teacher_top_log_probs"], 0.5),
    )


@pytest.mark.slow  # two one-step runs each: 15 s (reverse_kl) and 25 s (jsd) on 2 busy cores
@pytest.mark.parametrize(
    "objective",
    [("algorithm.distill.objective=reverse_kl",), ("algorithm.distill.objective=jsd", "teacher.top_k=8")],
    ids=["reverse_kl", "jsd"],
)
def test_a_run_with_a_padded_teacher_equals_the_run_with_the_unpadded_one(
    rl_files, teacher_dir, padded_teacher_dir, tmp_path, objective
):
    runs = [
        RLTrainer(
            distill_config(
                rl_files, tmp_path / name, teacher, *objective, "trainer.total_steps=1", "data.val_path="
            )
        ).fit()
        for name, teacher in (("plain", teacher_dir), ("padded", padded_teacher_dir))
    ]
    (plain,), (padded,) = ([h for h in run.history if h["step"] > 0] for run in runs)
    distilled = [name for name in plain if name.startswith("distill/")]
    assert distilled and all(padded[name] == plain[name] for name in distilled), distilled
    for name in ("actor/pg_loss", "actor/grad_norm", "critic/advantages/max", "critic/advantages/min"):
        assert padded[name] == plain[name], name


@pytest.mark.parametrize(
    ("teacher", "top_k", "sizes"),
    [
        ("teacher_dir", 200, "model_path=.* has 103 ids, teacher.model_path=.* 103"),
        ("padded_teacher_dir", 120, "103 ids, .* 153"),
    ],
)
def test_a_top_k_past_the_vocabulary_is_refused_before_any_worker_starts(
    rl_files, tmp_path, request, teacher, top_k, sizes
):
    """It used to be accepted, then crash in the first step's top-k."""
    config = distill_config(rl_files, tmp_path, request.getfixturevalue(teacher), f"teacher.top_k={top_k}")
    with pytest.raises(
        ValueError, match=f"teacher.top_k={top_k} is more than the 103 token ids the teacher scores .*{sizes}"
    ):
        RLTrainer(config)


def _working_directory() -> str:
    return os.getcwd()


@pytest.fixture
def relative_teacher(teacher_dir, tmp_path, monkeypatch, ray_cluster):
    """``"teacher"``: the teacher, relative to the driver's working directory (``tmp_path``),
    which is not the directory Ray's workers run in."""
    shutil.copytree(teacher_dir, tmp_path / "teacher")
    monkeypatch.chdir(tmp_path)
    assert ray_cluster.get(ray_cluster.remote(_working_directory).remote()) != str(tmp_path)
    return "teacher"


@pytest.mark.slow  # Ray starts a worker process: ~20 s on 2 busy cores (fast sibling: tests/rl/test_paths.py)
def test_a_relative_teacher_path_reaches_ray_teacher_workers_that_run_elsewhere(
    rl_files, teacher_dir, relative_teacher, tmp_path
):
    """A relative ``teacher.model_path`` reached Ray's workers as written (``FileNotFoundError: no
    model at teacher``); made absolute by the trainer, the teacher on Ray scores a batch as the
    local teacher with the absolute path does."""
    on_ray = RLTrainer(
        distill_config(rl_files, tmp_path / "run", relative_teacher, "trainer.backend=ray")
    ).config
    local = distill_config(rl_files, tmp_path / "run", teacher_dir)
    batch = padded_batch(load_tokenizer(teacher_dir), [("12+7=", "19"), ("3+45=", "48 and")])
    scored = []
    for config, backend in ((on_ray, "ray"), (local, "local")):
        with create_worker_group(
            TeacherWorker, config.teacher_resource_pool(), backend, args=(config,)
        ) as group:
            group.init_model()
            scored.append(group.compute_teacher_log_prob(batch)["teacher_log_probs"])
    assert torch.equal(scored[0], scored[1])


def test_a_relative_teacher_path_reaches_teacher_processes_started_elsewhere(
    rl_files, teacher_dir, tmp_path, monkeypatch
):
    """The trainer resolves a relative ``teacher.model_path`` against the caller's working
    directory, so teacher processes (the process backend) started in another directory, as Ray's
    workers are, score a batch as the teacher at its absolute path does; the path as written
    finds no model there. (On a real Ray cluster: the slow test above.)"""
    shutil.copytree(teacher_dir, tmp_path / "caller" / "teacher")
    monkeypatch.chdir(tmp_path / "caller")
    written = distill_config(rl_files, tmp_path / "run", "teacher")
    resolved = RLTrainer(written).config
    assert resolved.teacher.model_path == str(tmp_path / "caller" / "teacher")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the workers start here
    batch = padded_batch(load_tokenizer(teacher_dir), [("12+7=", "19"), ("3+45=", "48 and")])
    scored = []
    for config, backend in ((resolved, "process"), (distill_config(rl_files, tmp_path, teacher_dir), "local")):
        with create_worker_group(TeacherWorker, config.teacher_resource_pool(), backend, args=(config,)) as group:
            group.init_model()
            scored.append(group.compute_teacher_log_prob(batch)["teacher_log_probs"])
    assert torch.equal(scored[0], scored[1])
    with (
        create_worker_group(TeacherWorker, written.teacher_resource_pool(), "local", args=(written,)) as group,
        pytest.raises(WorkerError, match="no model at teacher: config.json is missing"),
    ):
        group.init_model()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("algorithm.distill.objective=reverse_kl",), "needs a teacher: set teacher.model_path"),
        (("teacher.model_path=/x",), "teacher.model_path is set but algorithm.distill.objective=none"),
        (
            ("algorithm.distill.objective=forward",),
            "algorithm.distill.objective='forward' is not registered; choose one of",
        ),
        (("teacher.placement=remote",), "teacher.placement"),
        (("algorithm.distill.coef=-1",), "algorithm.distill.coef"),
        (
            ("teacher.model_path=/x", "algorithm.distill.objective=jsd"),
            "compares distributions over the teacher's top-k tokens: set teacher.top_k",
        ),
        (("algorithm.distill.lmbda=0.5",), "lmbda=0.5 trains some steps on the dataset's responses"),
        (
            (
                "teacher.model_path=/x",
                "algorithm.distill.objective=jsd",
                "teacher.top_k=4",
                "algorithm.distill.reward_coef=0",
                "algorithm.distill.lmbda=0.5",
                "pipeline.mode=fully_async",
            ),
            "use pipeline.mode=sync",
        ),
        (
            ("preset=online_dpo", "teacher.model_path=/x", "algorithm.distill.objective=reverse_kl"),
            "online DPO",
        ),
    ],
)
def test_bad_distillation_settings_name_the_key(rl_files, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        small_config(rl_files, tmp_path, *overrides)


@pytest.mark.slow  # the distillation paths run in the default tier above; this is the demo end to end
def test_a_shrunk_distillation_demo_runs_end_to_end(tmp_path):
    runs = DemoSettings(
        output_dir=str(tmp_path), sft_steps=4, sft_batch_size=8, rl_steps=2, prompts_per_step=4,
        responses_per_prompt=4, mini_batch_prompts=4, val_prompts=8, val_every=1,
    )  # fmt: skip
    result = run_distill_demo(DistillDemoSettings(runs=runs))
    grpo, distill = accuracy_curve(result.grpo), accuracy_curve(result.distill)
    assert [step for step, _ in grpo] == [step for step, _ in distill] == [0, 1, 2]
    assert grpo[0] == distill[0]  # both start from the same warm-up
    trained = [h for h in result.distill.history if h["step"] > 0]
    assert all("distill/reverse_kl" in h for h in trained)
    assert (tmp_path / "distill" / "hf_model" / "config.json").exists()
    assert first_step_reaching([(0, 0.1), (4, 0.92), (8, 0.95)], 0.9) == 4
    assert first_step_reaching([(0, 0.1)], 0.9) is None


@pytest.fixture(scope="module")
def answered_rows(tmp_path_factory):
    """The arithmetic task's training rows, each with its answer as a worked response."""
    rows = arithmetic_rows(64, ArithmeticTaskConfig(max_digits=2), seed=0)
    for row in rows:
        row["extra_info"]["response"] = row["reward_model"]["ground_truth"]
    return str(write_parquet(rows, tmp_path_factory.mktemp("answered") / "train.parquet"))


def test_dataset_steps_train_the_forward_kl_on_the_rows_own_responses(
    rl_files, teacher_dir, answered_rows, tmp_path
):
    forward = (
        "algorithm.distill.objective=jsd", "algorithm.distill.beta=0", "teacher.top_k=8",
        "algorithm.distill.reward_coef=0", "actor.engine.lr=1e-2", f"data.train_path={answered_rows}",
    )  # fmt: skip
    offline = RLTrainer(
        distill_config(rl_files, tmp_path / "lmbda0", teacher_dir, *forward, "algorithm.distill.lmbda=0",
                       "trainer.total_steps=6")
    ).fit()  # fmt: skip
    steps = [h for h in offline.history if h["step"] > 0]
    assert all(h["distill/off_policy_step"] == 1.0 for h in steps)
    tokenizer = load_tokenizer(rl_files["model"])
    answers = [r["reward_model"]["ground_truth"] for r in read_rows(answered_rows)]
    lengths = {len(tokenizer.encode(a, add_special_tokens=False)) + 1 for a in answers}  # + EOS
    assert all(min(lengths) <= h["response_length/mean"] <= max(lengths) for h in steps)
    assert all(
        h["rollout_corr/kl"] == 0.0 for h in steps if "rollout_corr/kl" in h
    )  # no rollout to differ from
    loss = [h["distill/loss"] for h in steps]
    assert sum(loss[-2:]) / 2 < 0.75 * sum(loss[:2]) / 2, loss  # KL(teacher || student) falls on those tokens

    config = distill_config(
        rl_files,
        tmp_path / "lmbda05",
        teacher_dir,
        *forward,
        "algorithm.distill.lmbda=0.5",
        "trainer.total_steps=6",
    )
    mixed = RLTrainer(config).fit()
    pattern = [h["distill/off_policy_step"] == 1.0 for h in mixed.history if h["step"] > 0]
    assert pattern == [is_off_policy_step(config.trainer.seed, step, 0.5) for step in range(1, 7)]
    assert any(pattern) and not all(pattern)


def test_rows_without_a_response_are_named_before_the_first_step(rl_files, teacher_dir, tmp_path):
    overrides = (
        "algorithm.distill.objective=jsd", "teacher.top_k=4", "algorithm.distill.reward_coef=0",
        "algorithm.distill.lmbda=0.5",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"training prompt 0 .* no response in extra_info\['response'\]"):
        RLTrainer(distill_config(rl_files, tmp_path, teacher_dir, *overrides)).fit()
