"""``trainer.profile_steps``: the chosen steps leave one Chrome trace per worker, with named phases."""

import json

import pytest

from tandem.controller.profiling import ProfilesCalls
from tandem.rl import RLTrainer
from tests.rl.conftest import small_config


def _event_names(path):
    trace = json.loads(path.read_text())
    return {event.get("name") for event in trace["traceEvents"]}


def test_a_profiled_step_writes_a_trace_with_the_phases(rl_files, tmp_path):
    config = small_config(rl_files, tmp_path, "trainer.profile_steps=[2]", "data.val_path=")
    RLTrainer(config).fit()
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["step_2"]  # only the step asked for
    names = _event_names(tmp_path / "profile" / "step_2" / "rank0.json")
    # the draw stays on the workers (dataplane.enabled, the default): generate_to_store, not generate_sequences
    for phase in ("generate_to_store", "update_actor", "step/gen", "step/update_actor"):
        assert phase in names, phase
    assert any(name and name.startswith("aten::") for name in names)  # the operators inside


def test_two_workers_write_one_trace_each(rl_files, tmp_path):
    profile = tmp_path / "traces"
    config = small_config(
        rl_files, tmp_path / "run", "trainer.n_workers=2", "trainer.total_steps=1",
        "trainer.profile_steps=[1]", f"trainer.profile_dir={profile}", "data.val_path=",
    )  # fmt: skip
    RLTrainer(config).fit()
    for rank in (0, 1):
        assert "update_actor" in _event_names(profile / "step_1" / f"rank{rank}.json")


def test_rollout_replicas_of_an_async_run_write_their_own_traces(rl_files, tmp_path):
    config = small_config(
        rl_files, tmp_path, "pipeline.mode=fully_async", "trainer.total_steps=3", "trainer.profile_steps=[2]",
        "data.val_path=", "pipeline.trainer_threads=1", "pipeline.rollout_threads=1",
    )  # fmt: skip
    RLTrainer(config).fit()
    step = tmp_path / "profile" / "step_2"
    assert sorted(p.name for p in step.iterdir()) == ["rank0.json", "replica0.json"]
    events = [
        e for e in json.loads((step / "replica0.json").read_text())["traceEvents"] if e.get("ph") == "X"
    ]
    call_threads = {e["tid"] for e in events if e["name"] == "collect"}  # the controller's calls, named
    assert call_threads
    engine_ops = {e["name"] for e in events if e["tid"] not in call_threads}
    assert "aten::rms_norm" in engine_ops  # the engine's forwards, recorded on its own thread
    assert "update_actor" in _event_names(step / "rank0.json")


def test_profiler_misuse_and_bad_steps_are_named(rl_files, tmp_path):
    worker = ProfilesCalls()
    worker.rank = 3
    with pytest.raises(RuntimeError, match="rank 3 is not profiling"):
        worker.stop_profile()
    with pytest.raises(ValueError, match="trainer.profile_steps"):
        small_config(rl_files, tmp_path, "trainer.profile_steps=[0]")
