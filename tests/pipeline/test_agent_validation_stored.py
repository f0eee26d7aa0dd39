"""Agent runs' validation and ReMax's greedy episodes with ``dataplane.enabled``: each episode's
rows stay where it ran (a ``sync`` rank, an asynchronous replica), as the training episodes' do;
the controller gets the scalars and the conversations, scores the episodes on them, and has the
few logged validation responses decoded by a trainer rank that reads their tokens
(``response_texts``). Against the ``Batch`` path (every episode's sequences returned to the
controller): the same metrics and the same ``val_samples.jsonl`` (a logged response is its model
turns' tokens, the interaction's turns left out), nothing put or fetched by the controller, every
block released.
"""

import pytest

from tandem.dataplane import BatchRef
from tandem.protocol import Batch
from tandem.rl.validation import logged_rows
from tests.pipeline.test_async_agents_stored import INTERACTION
from tests.pipeline.test_async_dataplane import MODES, TWO_CORES
from tests.pipeline.test_async_greedy_stored import _comparable
from tests.pipeline.test_async_greedy_stored import _run as _greedy_run
from tests.rl.conftest import assert_same_histories
from tests.rl.test_dataplane_step import TOKEN_COLUMNS
from tests.rl.test_dataplane_validation import _assert_validation_stays_stored, _run, _val_samples, val_files

__all__ = ["val_files"]  # the fixture, shared with the single-turn validation tests


def _agent_run(files, out, tmp_path, *overrides):
    (tmp_path / "interaction.py").write_text(INTERACTION)
    return _run(
        files, out, "agent.name=interaction", f"agent.interaction_path={tmp_path / 'interaction.py'}",
        "agent.max_turns=2", "rollout.max_response_length=40", *overrides,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "overrides"),
    [
        ("sync", ("pipeline.mode=sync", "trainer.n_workers=2", "trainer.seed=5")),
        ("one_step_off", (*TWO_CORES, *MODES["one_step_off"])),
        pytest.param("fully_async", (*TWO_CORES, *MODES["fully_async"]), marks=pytest.mark.slow),  # the same replica path
    ],
)
def test_agent_validation_episodes_stay_stored_and_score_like_todays_path(val_files, tmp_path, mode, overrides):
    """``sync`` over two worker processes (metrics bit for bit), ``one_step_off`` (slow:
    ``fully_async``) with one replica (to float32 rounding: its episodes run side by side)."""
    off, today = _agent_run(val_files, tmp_path / "off", tmp_path, "dataplane.enabled=false", *overrides)
    on, refs = _agent_run(val_files, tmp_path / "on", tmp_path, *overrides)
    if mode == "sync":
        assert on.validation == off.validation
    else:
        assert on.validation == pytest.approx(off.validation, rel=1e-6)
    samples = _val_samples(on)
    assert samples == _val_samples(off) and len(samples) == 2 * 4  # 4 logged prompts, 2 validations
    assert any(sample["response"] for sample in samples)
    assert not any("again:" in sample["response"] for sample in samples)  # the interaction's turns left out
    for scored in refs.scored:  # scored on the conversations that came back with the scalars
        assert isinstance(scored, BatchRef) and "agent_messages" in scored.scalars
        assert "response_text" not in scored.scalars
    multi_turn = [m for s in refs.scored for m in s["agent_messages"] if sum(t["role"] == "user" for t in m) > 1]
    assert multi_turn, "no episode reached the interaction's second turn: the logged texts test nothing"
    if mode == "sync":
        _assert_validation_stays_stored(today, refs, blocks=2)
    else:  # the trainer's rank is this process: it reads the logged rows' responses, those alone
        _assert_validation_stays_stored(today, refs, blocks=1, rank_here_reads=("responses", "response_mask"))
        logged = sum(int(s.scalars["response_length"][logged_rows(len(s), 2)].sum()) for s in refs.scored)
        assert sum(used.fetched_bytes for used in refs.used) <= 4 * logged  # int32 ids at most


def test_an_agent_programs_validation_is_laid_out_as_its_draws(val_files, tmp_path):
    """An agent program whose system prompt makes its episodes' prompts wider than the dataset's, in
    ``sync``: both paths lay the validation episodes out at the draws' fixed prompt width, so the
    validation's response lengths count no prompt token (the ``Batch`` path once moved them into
    the response columns: ``val-aux/response_length/mean`` 63.25 against 59.08 here)."""
    pytest.importorskip("openai")
    from tests.pipeline.test_sync_program_stored import PROGRAM

    (tmp_path / "program.py").write_text(PROGRAM)
    program = (
        "pipeline.mode=sync", "agent.name=program", f"agent.program={tmp_path / 'program.py'}",
        "reward.sources=[interaction]", "rollout.max_response_length=120",
    )  # fmt: skip
    off, _ = _run(val_files, tmp_path / "off", "dataplane.enabled=false", *program)
    on, refs = _run(val_files, tmp_path / "on", *program)
    assert on.validation == off.validation and _val_samples(on) == _val_samples(off)
    assert all(isinstance(scored, BatchRef) for scored in refs.scored)
    widest_dataset_prompt = max(len(sample.prompt_ids) for sample in refs.val_data.samples)
    assert all(int(scored["prompt_length"].max()) > widest_dataset_prompt for scored in refs.scored)


@pytest.mark.parametrize("mode", ["one_step_off", "sync"])
def test_remax_greedy_episodes_of_an_agent_run_stay_stored(rl_files, tmp_path, mode):
    """ReMax over interaction episodes: each step's greedy episodes stay where they ran and are
    scored on their conversations; the metrics equal the off path's (to float32 rounding, as the
    training episodes': :mod:`tests.pipeline.test_async_agents_stored`)."""
    (tmp_path / "interaction.py").write_text(INTERACTION)
    agent = (
        "agent.name=interaction", f"agent.interaction_path={tmp_path / 'interaction.py'}", "agent.max_turns=2",
        "rollout.max_response_length=40", *{**MODES, "sync": ("pipeline.mode=sync", "trainer.seed=5")}[mode],
    )  # fmt: skip
    off, today = _greedy_run(rl_files, tmp_path / "off", "dataplane.enabled=false", *agent)
    on, refs = _greedy_run(rl_files, tmp_path / "on", *agent)
    assert_same_histories(_comparable(off), _comparable(on))
    assert len(refs.greedy) == len(today.greedy) == len(on)
    for greedy, batch in zip(refs.greedy, today.greedy, strict=True):
        assert isinstance(batch, Batch) and "responses" in batch  # today: the episodes' tokens came back
        assert isinstance(greedy, BatchRef) and "agent_messages" in greedy.scalars
        assert set(TOKEN_COLUMNS) <= set(greedy.stored_fields()) and not set(TOKEN_COLUMNS) & set(greedy.scalars.keys())
        assert sorted(greedy["index"]) == sorted(batch["index"])  # a draw's groups: as they finished
    n = refs.config.rollout.n
    for run in (today, refs):  # each greedy row is its draw's group's
        assert [list(g["index"]) for g in run.greedy] == [list(d["index"][::n]) for d in run.draws]
    for used in refs.draw_traffic:  # (in sync the in-process worker's put is this process's)
        assert used.fetched_bytes == 0 and (used.put_bytes == 0 or mode == "sync")
    assert refs.greedy_left == [[]] * len(on)
