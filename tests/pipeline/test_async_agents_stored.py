"""Agent episodes in the asynchronous pipelines with ``dataplane.enabled``: each replica keeps its
finished episode groups' training rows (each episode's own prompt, ``response_mask`` 0 on the user
turns, per-token versions) in its data-plane block, the controller holds references, per-row
scalars and the conversations, and the runs train on the same rows as the data plane's off path
(the controller maps the sample files and builds the padded batch): each step's rows equal, token
for token, the off path's. The metrics agree step for step to float32 rounding, not bit for bit: a
replica runs a draw's episodes side by side, so the groups come in the order they finished and the
engine's batches (the sampled log-probs' last bits) vary between runs, as with two replicas
(tests/pipeline/test_async_greedy_stored.py). The rows' equality bit for bit, split episodes
included, is tests/pipeline/test_stored_episodes.py."""

import pytest
import torch

from tandem.dataplane import BatchRef, get, traffic
from tandem.pipeline.stored_rollout import RESPONSE_TEXT
from tests.pipeline.test_async_dataplane import MODES, TWO_CORES, ReplicaRecordingTrainer, _files_of
from tests.rl.conftest import assert_same_histories, small_config
from tests.rl.test_dataplane_step import TOKEN_COLUMNS, assert_draws_stay_stored

INTERACTION = """
def respond(messages, extra_info):
    if sum(m["role"] == "assistant" for m in messages) >= 2:
        return {"content": None, "done": True, "reward": len(messages[-1]["content"]) / 10}
    return {"content": "again: " + extra_info["expression"] + "=", "done": False}
"""


TRAINED = (*TOKEN_COLUMNS, "response_mask", "weight_version", "rollout_log_probs")


class DrawCountingTrainer(ReplicaRecordingTrainer):
    """Also counts what the controller put into and fetched from the data plane while drawing and
    scoring each step's rows, and keeps each step's rows (fetched for the test, once the draw is
    counted) in the order of their request ids."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.draw_traffic: list = []
        self.rows: list = []

    def _policy_gradient_update(self, batch, timings):
        rows = batch.materialise(get, TRAINED) if isinstance(batch, BatchRef) else batch.select(list(TRAINED))
        order = list(range(len(rows)))  # sync's rows come in the prompts' order; a replica's as they finished
        if "request_id" in batch:
            order.sort(key=lambda i: batch["request_id"][i])
        self.rows.append(rows[torch.tensor(order)])
        return super()._policy_gradient_update(batch, timings)

    def scored_draw(self, draw, timings):
        start = traffic()
        result = super().scored_draw(draw, timings)
        self.draw_traffic.append(traffic() - start)
        return result


def _run(rl_files, out, interaction, *overrides):
    trainer = DrawCountingTrainer(
        small_config(
            rl_files,
            out,
            "data.val_path=",
            *TWO_CORES,
            "agent.name=interaction",
            f"agent.interaction_path={interaction}",
            "agent.max_turns=2",
            "rollout.max_response_length=40",  # a random model's turn that ends leaves room for another
            *overrides,
        )  # fmt: skip
    )
    return trainer.fit().history, trainer


def _comparable(history):  # a block's bytes are not a sample file's: the byte metrics differ
    return [{k: v for k, v in h.items() if not k.startswith("pipeline/inflight")} for h in history]


@pytest.mark.parametrize(
    "mode", ["one_step_off", "sync", pytest.param("fully_async", marks=pytest.mark.slow)]
)
def test_async_agent_episodes_stay_in_the_replicas_blocks_and_train_like_todays_path(
    rl_files, tmp_path, mode
):
    """Two steps of two-turn interaction episodes, one replica (``fully_async`` without staleness:
    the slow sibling)."""
    (tmp_path / "interaction.py").write_text(INTERACTION)
    interaction = tmp_path / "interaction.py"
    modes = {**MODES, "sync": ("pipeline.mode=sync", "trainer.seed=5")}  # a seed with a two-turn episode
    off, today = _run(rl_files, tmp_path / "off", interaction, *modes[mode], "dataplane.enabled=false")
    on, refs = _run(rl_files, tmp_path / "on", interaction, *modes[mode], "dataplane.enabled=true")
    assert_same_histories(_comparable(off), _comparable(on))
    for stored, batch in zip(refs.rows, today.rows, strict=True):  # the same rows, token for token
        for name in TRAINED:
            if name == "rollout_log_probs":
                assert torch.allclose(stored[name], batch[name], rtol=0, atol=1e-5)
            else:
                assert torch.equal(stored[name], batch[name]), name
    for rows in refs.rows:  # an episode's user turn is in its row: attended, not trained
        attended = rows["attention_mask"][:, rows["prompts"].shape[1] :]
        assert int(attended.sum()) > int(rows["response_mask"].sum())
    assert today.batch_bytes and all(b > 0 for b in today.batch_bytes)  # today: a padded batch
    assert_draws_stay_stored(refs)
    for draw in refs.draws:  # the conversations inline, scored on them; no decoded text stored
        assert "agent_messages" in draw.scalars and RESPONSE_TEXT not in draw.scalars
        assert {"response_mask", "weight_version", "position_ids"} <= set(draw.stored_fields())
    for used in refs.draw_traffic:  # the controller fetched nothing while drawing, nor put
        assert used.fetched_bytes == 0  # (in sync the in-process worker's put is this process's)
        assert used.put_bytes == 0 or mode == "sync"
    assert refs.step_bytes == [0] * len(on) and refs.left == [[]] * len(on)
    if mode != "sync":  # (in sync the controller sends the workers the requests, as a Batch)
        assert refs.gen_bytes == [0] * len(on)  # no Batch serialised or rebuilt for the draw either
    assert not _files_of(refs.replica_pids)


@pytest.mark.slow  # two 2-step runs of an agent program (its endpoint and episodes on the replica)
def test_async_split_program_episodes_stay_in_the_replicas_blocks(rl_files, tmp_path):
    """An agent program that summarises its history (each episode split into segments) in
    ``fully_async``: the same rows as the off path, their positions restarting per segment (on
    every attended token: the controller also zeroes other rows' padding), metrics to fp32."""
    pytest.importorskip("openai")
    from tests.agents.test_program_segments import SPLITTING

    program = SPLITTING.replace('info = row["extra_info"]', 'info = {"turns": 2, "rewrite": [0], "marker": "!",'
                                ' "log": "/dev/null"}')  # fmt: skip
    (tmp_path / "agent.py").write_text(program)
    settings = (
        "agent.name=program", f"agent.program={tmp_path / 'agent.py'}", "reward.sources=[interaction]",
        "rollout.max_response_length=120", *MODES["fully_async"],
    )  # fmt: skip
    runs = []
    for name, extra in (("off", ("dataplane.enabled=false",)), ("on", ("dataplane.enabled=true",))):
        trainer = DrawCountingTrainer(
            small_config(rl_files, tmp_path / name, "data.val_path=", *TWO_CORES, *settings, *extra)
        )
        runs.append((trainer.fit().history, trainer))
    (off, today), (on, refs) = runs
    assert_same_histories(_comparable(off), _comparable(on))
    assert all(h["agent/program/splits"] > 0 and h["agent/program/errors"] == 0 for h in on)
    for stored, batch in zip(refs.rows, today.rows, strict=True):
        attended = batch["attention_mask"].bool()
        for name in TRAINED:
            if name == "rollout_log_probs":
                assert torch.allclose(stored[name], batch[name], rtol=0, atol=1e-5)
            elif name == "position_ids":
                assert torch.equal(stored[name][attended], batch[name][attended])
            else:
                assert torch.equal(stored[name], batch[name]), name
    assert_draws_stay_stored(refs)
    assert all(used.put_bytes == used.fetched_bytes == 0 for used in refs.draw_traffic)
    assert refs.gen_bytes == [0] * len(on) and not _files_of(refs.replica_pids)
