"""An agent program's episodes in ``pipeline.mode=sync`` with ``dataplane.enabled``: each worker keeps
its episodes' training rows in its own store, laid out at a prompt width fixed before the draw
(:func:`tandem.rl.batch_source.stored_prompt_width`: the training set's widest prompt, at least
``data.max_prompt_length``, plus ``rollout.max_response_length``, as the asynchronous replicas' rows),
and the controller crops the reference to the draw's longest prompt and response. With the setting off
the draw is laid out at the same width and trimmed (``ColocatedRollout(fixed_prompt_width=True)``), so
both paths train on the same rows: each step's rows equal, token for token, the off path's, a split
episode's positions restarting at 0 where its later segments start included. The references: the off
run's rows and metrics (to float32 rounding: the worker runs a draw's episodes side by side, so the
engine's batches, and the sampled log-probs' last bits, vary between runs)."""

import pytest
import torch

from tests.pipeline.test_async_agents_stored import TRAINED, DrawCountingTrainer, _comparable
from tests.pipeline.test_async_dataplane import TWO_CORES
from tests.rl.conftest import assert_same_histories, small_config
from tests.rl.test_dataplane_step import assert_draws_stay_stored

pytest.importorskip("openai")

# A system prompt the dataset's prompts do not have (the episode's prompt is wider than theirs), two
# requests, and on an even seed a summary instead of the first reply: the second request then starts
# a new segment (a split episode), on an odd one it continues the row.
PROGRAM = """
async def run(client, row):
    messages = [{"role": "system", "content": "Answer briefly."}, *row["messages"]]
    sampled = ""
    for turn in range(2):
        reply = await client.chat.completions.create(model="any", messages=messages, max_tokens=6)
        message = reply.choices[0].message.model_dump(exclude_none=True)
        sampled += message.get("content") or ""
        split = turn == 0 and row["seed"] % 2 == 0
        messages.append({"role": "assistant", "content": "(summary)"} if split else message)
        messages.append({"role": "user", "content": "again"})
    return sum(c.isdigit() for c in sampled) / 12
"""


def _run(rl_files, out, program, *overrides):
    trainer = DrawCountingTrainer(
        small_config(
            rl_files,
            out,
            "data.val_path=",
            *TWO_CORES,
            "pipeline.mode=sync",
            "agent.name=program",
            f"agent.program={program}",
            "reward.sources=[interaction]",
            "rollout.max_response_length=120",
            *overrides,
        )
    )
    return trainer.fit().history, trainer


def _assert_trained_like_todays_path(rl_files, tmp_path, *overrides):
    """Two runs, off and on, of GRPO over the program's episodes: the checks of the module docstring;
    returns the two trainers (today's, the references')."""
    (tmp_path / "agent.py").write_text(PROGRAM)
    off, today = _run(rl_files, tmp_path / "off", tmp_path / "agent.py", "dataplane.enabled=false", *overrides)
    on, refs = _run(rl_files, tmp_path / "on", tmp_path / "agent.py", "dataplane.enabled=true", *overrides)
    assert_same_histories(_comparable(off), _comparable(on))
    assert all(h["agent/program/splits"] > 0 and h["agent/program/errors"] == 0 for h in on)
    widest = max(len(sample.prompt_ids) for sample in refs.train_data.samples)
    for stored, batch, draw in zip(refs.rows, today.rows, refs.draws, strict=True):
        for name in TRAINED:  # the same rows, token for token (positions on the padding too)
            if name == "rollout_log_probs":
                assert torch.allclose(stored[name], batch[name], rtol=0, atol=1e-5)
            else:
                assert torch.equal(stored[name], batch[name]), name
        assert stored["prompts"].shape[1] > widest  # the system prompt stays in the prompt columns
        splits = torch.tensor([int(n) for n in draw["agent_program_splits"]])
        assert bool((splits > 0).any() and (splits == 0).any())  # split and unsplit episodes
        attended = stored["attention_mask"].bool()
        restarts = [
            int((row[mask] == 0).sum()) for row, mask in zip(stored["position_ids"], attended, strict=True)
        ]
        assert restarts == (1 + splits).tolist()  # positions restart at 0 where each segment starts
    assert today.batch_bytes and all(b > 0 for b in today.batch_bytes)  # today: a padded batch
    assert_draws_stay_stored(refs)
    for draw in refs.draws:  # the split rows' positions are stored: not the derivable plain ones
        assert {"response_mask", "weight_version", "position_ids"} <= set(draw.stored_fields())
        assert "agent_messages" in draw.scalars
    assert all(used.fetched_bytes == 0 for used in refs.draw_traffic)  # the controller read no field
    assert refs.step_bytes == [0] * len(on) and refs.left == [[]] * len(on)
    return today, refs


def test_sync_program_episodes_stay_on_the_workers_and_train_like_todays_path(rl_files, tmp_path):
    """One in-process worker (its puts are this process's: the slow sibling counts the controller's)."""
    _assert_trained_like_todays_path(rl_files, tmp_path)


@pytest.mark.slow  # two 2-step runs over 2 spawned workers, each hosting the program's endpoint
def test_sync_program_episodes_over_two_workers_put_nothing_on_the_controller(rl_files, tmp_path):
    """Each of 2 spawned workers keeps its own rows; the controller puts no byte while drawing, and
    the generated batch no longer comes back to it (only the requests go)."""
    today, refs = _assert_trained_like_todays_path(rl_files, tmp_path, "trainer.n_workers=2")
    assert all(used.put_bytes == 0 for used in refs.draw_traffic)
    for gen_today, gen_refs, batch in zip(today.gen_bytes, refs.gen_bytes, today.batch_bytes, strict=True):
        assert gen_refs + batch <= gen_today, (gen_today, gen_refs, batch)
    print(f"in generation: today {today.gen_bytes}, refs {refs.gen_bytes}; batch {today.batch_bytes}")
