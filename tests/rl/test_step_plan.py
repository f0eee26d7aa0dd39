"""The step plan: each algorithm's config selects its stages from the registry (the expected
plans written out below), where old log-probs come from is decided once, two stages claiming one
slot are refused by name; and the plan keeps every algorithm's step what it was: GRPO, PPO with a
critic, DAPO's dynamic sampling, ReMax, online DPO, distillation and GKD, two fixed-seed steps
each, give the metrics recorded from the trainer before :mod:`tandem.rl.step_plan` existed
(``golden/step_plan/*.json``; wall-clock times and memory readings aside, their names kept).
Regenerate them with ``TANDEM_UPDATE_GOLDEN=1`` only for a change that means to alter a step."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tandem.data import write_parquet
from tandem.rl import RLTrainer, load_train_config
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows
from tandem.rl.plan import run_plan
from tandem.rl.stages import STEP_STAGES, register_step_stage
from tandem.rl.step_plan import build_step_plan
from tests.rl.conftest import assert_same_histories, small_config

GOLDEN = Path(__file__).parent / "golden" / "step_plan"

TEACHER = ("teacher.model_path=MODEL", "teacher.top_k=2")
CASES = {  # name -> overrides of tests.rl.conftest.small_config
    "grpo": (),  # the KL loss's reference pass; old log-probs from the update's forward
    "grpo_old_log_prob_pass": ("actor.ppo_mini_batch_size=2",),  # two optimizer steps: a pass first
    "ppo_critic": ("preset=ppo",),
    "dapo": ("preset=dapo", "algorithm.filter_groups.max_num_gen_batches=2"),
    "remax": ("preset=remax",),
    "online_dpo": ("preset=online_dpo",),
    "distill": (*TEACHER, "algorithm.distill.objective=reverse_kl"),
    "gkd": (  # step 1 trains on the rows' own responses, step 2 on sampled ones (seed 0, lmbda 0.5)
        *TEACHER,
        "algorithm.distill.objective=jsd",
        "algorithm.distill.beta=0",
        "algorithm.distill.reward_coef=0",
        "algorithm.distill.lmbda=0.5",
        "data.train_path=ANSWERED",
    ),  # fmt: skip
}


PLANS = {  # overrides -> (collect, draws, update, prepares, passes, views, old log-probs)
    (): ("one_draw", (), "policy_gradient", (), ("reference",), (), "update"),
    ("actor.ppo_mini_batch_size=2",): ("one_draw", (), "policy_gradient", (), ("old_log_probs", "reference"), (), "pass"),
    ("preset=ppo",): ("one_draw", (), "policy_gradient", (), ("old_log_probs", "reference", "critic"), (), "pass"),
    ("preset=dapo",): ("dynamic_sampling", (), "policy_gradient", (), (), (), "update"),
    ("preset=remax",): ("one_draw", ("greedy_baseline",), "policy_gradient", (), (), (), "update"),
    ("preset=online_dpo",): ("one_draw", (), "preference", (), ("reference",), (), "none"),
    ("preset=online_dpo", "trainer.n_workers=2"): ("one_draw", (), "preference", (), ("reference",), (), "none"),
    ("trainer.n_workers=2",): ("one_draw", (), "policy_gradient", ("balance",), ("reference",), (), "update"),
    ("pipeline.mode=one_step_off",): ("one_draw", (), "policy_gradient", (), ("old_log_probs", "reference"), (), "pass"),
    ("pipeline.mode=one_step_off", "pipeline.old_log_probs=rollout"): (
        "one_draw", (), "policy_gradient", ("rollout_old_log_probs",), ("reference",), (), "rollout",
    ),
    ("teacher.model_path=/t", "algorithm.distill.objective=reverse_kl"): (
        "one_draw", (), "policy_gradient", (), ("reference", "teacher"), (), "update",
    ),
    (
        "teacher.model_path=/t", "algorithm.distill.objective=jsd", "teacher.top_k=2",
        "algorithm.distill.reward_coef=0", "algorithm.distill.lmbda=0.5",
    ): (
        "one_draw", (), "policy_gradient", (), ("dataset_old_log_probs", "reference", "teacher"), (), "update",
    ),
}  # fmt: skip


def plan_config(*overrides):
    return load_train_config(["model_path=/m", "data.train_path=/d", "rollout.n=4", *overrides])


@pytest.mark.parametrize("overrides", list(PLANS), ids=lambda o: " ".join(o) or "grpo")
def test_each_config_selects_its_algorithms_stages(overrides):
    collect, draws, update, prepares, passes, views, old = PLANS[overrides]
    plan = build_step_plan(plan_config(*overrides))
    assert plan.names() == {
        "collect": (collect,), "draw": draws, "update": (update,), "prepare": prepares, "pass": passes, "view": views,
    }  # fmt: skip
    assert plan.old_log_probs == old
    stages = {collect, *draws, update, *prepares, *passes, *views}
    assert plan.takes_stored_draws == (not stages & BUILT_ON_THE_CONTROLLER)


BUILT_ON_THE_CONTROLLER: set[str] = set()  # built-in stages whose draws are built on the controller (StepStage.stored)


class Prompts(list):
    filtered = 0  # what run_plan reads of the training data: its length and the prompts filtered out


def test_the_run_plan_prints_the_step_plan():
    config = plan_config("preset=remax")
    printed = run_plan(config, build_step_plan(config), 10**6, Prompts([0] * 8), 0, 2, 0).splitlines()
    assert printed[-1] == (
        "  step: collect one_draw (draw: greedy_baseline) -> update policy_gradient; "
        "old log-probs: the update's forward"
    )


@pytest.fixture
def stage_registry():
    """The stage registry as tandem left it, after the test."""
    saved = dict(STEP_STAGES._entries)
    yield STEP_STAGES
    STEP_STAGES._entries = saved


def test_two_stages_claiming_one_slot_are_refused_by_name(stage_registry):
    register_step_stage("every_draw_twice", "collect", applies=lambda config: True)(
        lambda trainer, timings: None
    )
    assert build_step_plan(plan_config()).collect.name == "every_draw_twice"  # it displaces the default
    with pytest.raises(
        ValueError, match=r"\['dynamic_sampling', 'every_draw_twice'\] all apply to the collect slot"
    ):
        build_step_plan(plan_config("preset=dapo"))
    with pytest.raises(ValueError, match="step stage 'every_draw_twice' is already registered"):
        register_step_stage("every_draw_twice", "draw", applies=lambda config: True)(lambda *args: None)
    with pytest.raises(ValueError, match=r"slot='after'; choose one of \['collect'"):
        register_step_stage("late", "after", applies=lambda config: True)(lambda *args: None)


def test_the_trainer_and_the_worker_ask_no_algorithm_flag():
    """What a step runs is the plan's: the flags that once chose the step's shape are read by stages."""
    root = Path(__file__).parents[2] / "tandem" / "rl"
    trainer, worker = (root / "trainer.py").read_text(), (root / "worker.py").read_text()
    for flag in (
        "prefers",
        "filter_groups",
        "needs_greedy_baseline",
        "distills",
        "needs_reference",
        "old_log_probs_from",
    ):
        assert flag not in trainer, flag
    for flag in ("prefers", "filter_groups", "needs_greedy_baseline", "adv_estimator"):
        assert flag not in worker, flag


ALGORITHM_FLAGS = (  # what chooses a step's shape: read only by the stage modules that declare it
    "prefers", "filter_groups", "needs_greedy_baseline", "lmbda", "needs_values", "actor.objective",
    "algorithm.needs_reference", "preference.needs_reference", "advantages_need_old_log_probs",
)  # fmt: skip


@pytest.mark.parametrize(
    "module",
    ["step_data.py", "config/rules.py", "config/train.py", "batch_source.py", "trainer.py", "worker.py"],
)
def test_the_config_the_batch_source_and_the_store_decision_ask_the_plan_not_the_algorithm_flags(module):
    """Whether a run's draws stay stored (``rollout_stays_in_store``) is the plan's stages' say
    (``StepStage.stored``), and the rules of online DPO, DAPO and GKD are their stages' own
    (``StepStage.rule``); where old log-probs come from, whether the reference runs and a critic
    trains are the update's declarations (``TrainConfig`` asks the plan); what a replay refuses and
    which source a step draws from (GKD's dataset steps) are the stages' (``replay=``,
    ``batch_source=``): none of these modules reads an algorithm's flag."""
    source = (Path(__file__).parents[2] / "tandem" / "rl" / module).read_text()
    for flag in ALGORITHM_FLAGS:
        assert flag not in source, (module, flag)


def test_what_the_run_asks_the_plan_is_its_stages_declarations(stage_registry):
    """The update declares old log-probs, reference and critic; a stage declares what a replay
    cannot run; ``TrainConfig`` answers from them (a plugin's update is asked the same way)."""
    ppo, dpo = plan_config("preset=ppo"), plan_config("preset=online_dpo")
    assert (ppo.old_log_probs_source, ppo.needs_reference, ppo.uses_critic) == ("pass", True, True)
    assert (dpo.old_log_probs_source, dpo.needs_reference, dpo.uses_critic) == ("none", True, False)
    remax = plan_config("preset=remax")
    assert build_step_plan(remax).replay_refusals(remax) == [
        "algorithm.adv_estimator=remax generates greedy baselines each step"
    ]
    assert build_step_plan(ppo).replay_refusals(ppo) == []
    with pytest.raises(ValueError, match="old_log_probs=, reference= are an update's declarations"):
        register_step_stage(
            "late_pass", "pass", applies=lambda c: True, old_log_probs=lambda c: "pass", reference=bool
        )(lambda *args: None)
    register_step_stage(
        "critic_free_update", "update", applies=lambda c: c.algorithm.adv_estimator == "gae",
        runs=("pass",), old_log_probs=lambda c: "pass",
    )(lambda *args: None)  # fmt: skip
    gae = plan_config("algorithm.adv_estimator=gae")
    assert (gae.old_log_probs_source, gae.needs_reference, gae.uses_critic) == ("pass", False, False)
    assert build_step_plan(gae).names()["pass"] == ("old_log_probs",)


@pytest.fixture(scope="module")
def answered_rows(tmp_path_factory):
    """The arithmetic task's training rows, each with its answer as a worked response (for GKD)."""
    rows = arithmetic_rows(64, ArithmeticTaskConfig(max_digits=2), seed=0)
    for row in rows:
        row["extra_info"]["response"] = row["reward_model"]["ground_truth"]
    return str(write_parquet(rows, tmp_path_factory.mktemp("answered") / "train.parquet"))


def measured(history: list[dict]) -> list[dict]:
    """Each step's metrics, its wall-clock times and memory readings (they vary run to run) as
    ``None``: their names still say which stages ran."""
    return [
        {name: None if _varies(name) else value for name, value in metrics.items()} for metrics in history
    ]


def _varies(name: str) -> bool:
    return name.startswith(("timing_s", "perf/", "memory/")) or name.endswith(("_s", "_gbps"))


def case_history(rl_files, answered_rows, output_dir, name: str) -> list[dict]:
    """The measured history of case ``name``'s two-step run."""
    swap = {"MODEL": rl_files["model"], "ANSWERED": answered_rows}
    overrides = [o.split("=")[0] + "=" + swap.get(o.split("=")[1], o.split("=")[1]) for o in CASES[name]]
    config = small_config(rl_files, output_dir, "data.val_path=", *overrides)
    return measured(RLTrainer(config).fit().history)


@pytest.mark.slow  # eight pairs of two-step runs; the plans' own choice is the fast tests' above
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_algorithms_step_gives_the_metrics_it_gave_before_the_step_plan(
    rl_files, answered_rows, tmp_path, name
):
    history = case_history(rl_files, answered_rows, tmp_path, name)
    golden = GOLDEN / f"{name}.json"
    if os.environ.get("TANDEM_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(json.dumps(history, indent=1, sort_keys=True) + "\n")
    assert len(history) == 2
    expected = json.loads(golden.read_text())
    # The goldens were recorded on another host's kernels (an AMD EPYC; this check also runs on
    # Intel Xeons). Step 1, before any update, is the tight check: 1e-5 relative, with 1e-6 absolute
    # for quantities that are zero in exact arithmetic (a policy loss over advantages summing to
    # zero, the gradient norm of a step whose groups all scored alike: fp32 rounding, ~1e-8 apart
    # per host). Step 2 follows one AdamW update, which turns host-dependent rounding of gradient
    # elements near eps into weight changes of up to lr (tests/sft/adam_bound.py): GKD's step-2
    # reverse KL, ~1e-5, differs by half between hosts. So step 2 is a coarse check (10%, 1e-4).
    assert_same_histories(expected[:1], history[:1], absolute=1e-6)
    assert_same_histories(expected[1:], history[1:], absolute=1e-4, relative=0.1)
