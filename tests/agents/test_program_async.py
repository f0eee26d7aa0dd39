"""Agent programs in the asynchronous pipelines (``pipeline.mode=one_step_off|fully_async``): the
episodes run on a rollout replica's :class:`~tandem.pipeline.groups.GroupTracker`, over the
replica's engine, and reach the trainer through :func:`~tandem.pipeline.runner.assemble_batch`.

The references: the token ids the endpoint returned to the program (what it sampled, logged by the
program itself) against the assembled training rows' model tokens, the trainer's fp32 log-probs
against the rollout's, the weight version the engine held for each request against the versions
the row carries, and each episode's own marker against the text its row decodes to. The full
multi-step runs are the slow siblings."""

import json
import re
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
from starlette.testclient import TestClient  # noqa: E402

from tandem.agents.config import AgentConfig  # noqa: E402
from tandem.agents.loops import batch_episode_metrics, episode_metrics  # noqa: E402
from tandem.agents.program.endpoint import ProgramEndpoint  # noqa: E402
from tandem.agents.program.recorder import EpisodeRecord  # noqa: E402
from tandem.agents.rollout import AgentRollout  # noqa: E402
from tandem.agents.trajectory import TurnEncoder  # noqa: E402
from tandem.models import load_tokenizer  # noqa: E402
from tandem.pipeline.groups import EpisodePrompt, GroupRequest, GroupTracker  # noqa: E402
from tandem.pipeline.provenance import SEED  # noqa: E402
from tandem.pipeline.runner import assemble_batch  # noqa: E402
from tandem.pipeline.sample_store import InlineWriter  # noqa: E402
from tandem.rl.data import RLDataset  # noqa: E402
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, SamplingParams  # noqa: E402
from tests.agents.test_program_agent import trainer_log_probs  # noqa: E402

N = 2  # episodes per prompt group

PROGRAM = """
import asyncio, json, os


async def run(client, row):
    info, seed = row["extra_info"], row["seed"]
    if info.get("fail") and seed % 2:
        raise RuntimeError("the agent crashed")
    messages, sampled, versions = list(row["messages"]), [], []
    for turn in range(2):
        reply = await client.chat.completions.create(model="any", messages=messages, max_tokens=5)
        sampled.append(reply.choices[0].model_extra["token_ids"])
        versions.append(reply.choices[0].model_extra["weight_versions"])
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": info["marker"] + " again"})
        if turn == 0 and info.get("gate"):  # wait here until the test has updated the weights
            open(info["gate"] + ".reached", "w").close()
            while not os.path.exists(info["gate"] + ".open"):
                await asyncio.sleep(0.01)
    with open(os.path.join(info["log"], f"{seed}.json"), "w") as log:
        json.dump({"sampled": sampled, "versions": versions}, log)
    return {"reward": 0.5, "metrics": {"requests": 2, "odd": seed % 2}}
"""

COMMAND = """
import json, os, sys, urllib.request

row = json.load(sys.stdin)
info, seed = row["extra_info"], row["seed"]
if info.get("fail") and seed % 2:
    sys.exit(3)
messages, sampled = list(row["messages"]), []
for turn in range(2):
    body = json.dumps({"model": "any", "messages": messages, "max_tokens": 5}).encode()
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
    )
    choice = json.loads(urllib.request.urlopen(request).read())["choices"][0]
    sampled.append(choice["token_ids"])
    messages.append({"role": "assistant", "content": choice["message"]["content"]})
    messages.append({"role": "user", "content": info["marker"] + " again"})
with open(os.path.join(info["log"], f"{seed}.json"), "w") as log:
    json.dump({"sampled": sampled}, log)
print(json.dumps({"reward": 0.5, "metrics": {"requests": 2, "odd": seed % 2}}))
"""


@pytest.fixture(scope="module")
def setup(rl_files, tmp_path_factory):
    """``(root, tokenizer, dataset, model)``: the RL files' tiny model and training data, and the
    two programs written under ``root``."""
    root = tmp_path_factory.mktemp("program_async")
    (root / "program.py").write_text(PROGRAM)
    (root / "command.py").write_text(COMMAND)
    tokenizer = load_tokenizer(rl_files["model"])
    return root, tokenizer, RLDataset.load(rl_files["train"], tokenizer, 64), rl_files["model"]


def agent_config(root: Path, kind: str) -> AgentConfig:
    if kind == "function":
        return AgentConfig(name="program", program=str(root / "program.py"))
    return AgentConfig(name="program", program_command=(sys.executable, str(root / "command.py")))


def sampling(tokenizer) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=40, stop_token_ids=(tokenizer.eos_token_id,))


def groups_of(rows: list[dict], tokenizer) -> list[GroupRequest]:
    """One prompt group (``N`` episodes, seeds ``10g + k``) per row of ``extra_info``; the
    dataset's row ``g`` supplies the group's other columns."""
    return [
        GroupRequest(
            f"g{g}", g, (), tuple(10 * g + k for k in range(N)), sampling(tokenizer),
            EpisodePrompt(({"role": "user", "content": f"{row['marker']} start"},), row),
        )
        for g, row in enumerate(rows)
    ]  # fmt: skip


def collect_all(tracker: GroupTracker, expected: int, seconds: float = 60.0) -> list:
    metas, deadline = [], time.monotonic() + seconds
    while len(metas) < expected and time.monotonic() < deadline:
        metas += tracker.collect(wait_s=0.05)
    assert len(metas) == expected, f"only {len(metas)} of {expected} groups finished"
    return sorted(metas, key=lambda meta: meta.index)


def engine_of(model: str) -> NativeRolloutEngine:
    return NativeRolloutEngine.from_pretrained(model, NativeEngineConfig(max_num_seqs=16, max_model_len=256))


@pytest.mark.parametrize("kind", ["function", "command"])
def test_replica_program_episodes_train_the_sampled_tokens_and_count_their_faults(setup, tmp_path, kind):
    """Two groups on a replica's tracker, the second's odd-seeded episode failing: the assembled
    rows hold exactly the tokens the endpoint sent, the trainer's log-probs equal the rollout's,
    and the programs' metrics, rewards and faults reach the rows and the step's metrics."""
    root, tokenizer, dataset, model = setup
    rows = [{"marker": f"<p{g}>", "log": str(tmp_path), "fail": g == 1} for g in range(2)]
    engine = engine_of(model)
    agents = AgentRollout(agent_config(root, kind), tokenizer, engine)
    tracker = GroupTracker(replica=0, writer=InlineWriter(), agents=agents)
    try:
        tracker.start(engine, groups_of(rows, tokenizer))
        metas = collect_all(tracker, len(rows))
    finally:
        agents.close()
        engine.close()
    batch = assemble_batch(metas, dataset, N, tokenizer.pad_token_id)
    mask = batch["response_mask"].bool()
    failed = [g == 1 and k % 2 == 1 for g in range(2) for k in range(N)]
    for i, fails in enumerate(failed):
        seed = batch[SEED][i]
        assert seed == 10 * (i // N) + i % N
        if fails:
            assert batch["finish_reason"][i] == "program_error" and batch["agent_reward"][i] == 0.0
            assert batch["agent_program_metrics"][i] == {}
            why = "raised RuntimeError" if kind == "function" else "exited with status 3"
            assert why in batch["agent_program_log"][i]["error"]
            continue
        log = json.loads((tmp_path / f"{seed}.json").read_text())
        assert batch["responses"][i][mask[i]].tolist() == [t for turn in log["sampled"] for t in turn]
        assert batch["agent_reward"][i] == 0.5 and batch["agent_program_splits"][i] == 0
        assert batch["agent_program_metrics"][i] == {"requests": 2.0, "odd": float(seed % 2)}
        assert batch["agent_program_log"][i]["error"] == ""
        marker = rows[i // N]["marker"]
        text = tokenizer.decode(batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist())
        # the marker of the prompt and of the one user turn sent back, and no other episode's
        assert set(re.findall(r"<p\d>", text)) == {marker} and text.count(marker) == 2, text
    diff = (trainer_log_probs(model, batch) - batch["rollout_log_probs"])[mask]
    assert diff.numel() >= 3 * 2 and diff.abs().max() <= 1e-5, float(diff.abs().max())
    metrics = batch_episode_metrics(batch, lambda: [])
    assert metrics["agent/program/errors"] == 1.0 and metrics["agent/program/splits"] == 0.0
    assert metrics["agent/program/metric/requests"] == 2.0  # over the three episodes that returned it
    assert metrics["agent/program/metric/odd"] == pytest.approx(1 / 3)  # seeds 0, 1, 10: one odd


def test_a_weight_update_between_requests_gives_the_later_tokens_the_new_version(setup, tmp_path):
    """The replica's engine takes weights version 1 (the same values: the trainer's log-probs stay
    the reference) while an episode waits between its two requests, as a sync in one_step_off or
    fully_async does: the first request's tokens carry 0, the second's 1, the masked turns -1."""
    root, tokenizer, dataset, model = setup
    gate = tmp_path / "gate"
    rows = [{"marker": "<p0>", "log": str(tmp_path), "gate": str(gate)}]
    engine = engine_of(model)
    agents = AgentRollout(agent_config(root, "function"), tokenizer, engine)
    tracker = GroupTracker(replica=0, writer=InlineWriter(), agents=agents)
    try:
        tracker.start(engine, groups_of(rows, tokenizer)[:1])
        deadline = time.monotonic() + 60
        while not Path(f"{gate}.reached").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.pause("wait")  # what a replica's receive_weights does
        engine.update_weights(list(engine.model.state_dict().items()), version=1)
        engine.resume()
        Path(f"{gate}.open").touch()
        (meta,) = collect_all(tracker, 1)
    finally:
        agents.close()
        engine.close()
    assert (meta.min_version, meta.max_version) == (0, 1)
    batch = assemble_batch([meta], dataset, N, tokenizer.pad_token_id)
    mask = batch["response_mask"].bool()
    for i in range(N):
        log = json.loads((tmp_path / f"{i}.json").read_text())
        first, second = log["sampled"]
        assert log["versions"] == [[0] * len(first), [1] * len(second)]  # what the endpoint returned
        versions = batch["weight_version"][i]
        assert versions[mask[i]].tolist() == [0] * len(first) + [1] * len(second)
        length = int(batch["attention_mask"][i, batch["prompts"].shape[1] :].sum())
        assert set(versions[:length][~mask[i][:length]].tolist()) <= {-1}  # the user turn's tokens
    diff = (trainer_log_probs(model, batch) - batch["rollout_log_probs"])[mask]
    assert diff.abs().max() <= 1e-5


@pytest.mark.slow
def test_sixty_four_concurrent_episodes_on_one_replica_engine_never_mix(setup, tmp_path):
    """32 groups of 2 episodes at once on one engine (64 sequences a step): each row decodes to
    its own group's marker only and holds exactly the tokens its own episode was sent (the
    16-episode sync sibling is tests/agents/test_program_agent.py's default-tier test)."""
    root, tokenizer, dataset, model = setup
    rows = [{"marker": f"<q{g:02d}>", "log": str(tmp_path)} for g in range(32)]
    engine = NativeRolloutEngine.from_pretrained(
        model, NativeEngineConfig(max_num_seqs=64, max_model_len=256)
    )
    agents = AgentRollout(agent_config(root, "function"), tokenizer, engine)
    tracker = GroupTracker(replica=0, writer=InlineWriter(), agents=agents)
    try:
        tracker.start(engine, groups_of(rows, tokenizer))
        metas = collect_all(tracker, len(rows), seconds=300)
    finally:
        agents.close()
        engine.close()
    batch = assemble_batch(metas, dataset, N, tokenizer.pad_token_id)
    mask = batch["response_mask"].bool()
    assert len(batch) == 64 and len(set(batch[SEED])) == 64
    for i in range(64):
        marker = rows[i // N]["marker"]
        text = tokenizer.decode(batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist())
        assert set(re.findall(r"<q\d\d>", text)) == {marker} and text.count(marker) == 2, text
        log = json.loads((tmp_path / f"{batch[SEED][i]}.json").read_text())
        assert batch["responses"][i][mask[i]].tolist() == [t for turn in log["sampled"] for t in turn]


STUCK = """
import openai


async def run(client, row):
    try:
        await client.chat.completions.create(model="any", messages=row["messages"], max_tokens=5)
    except openai.APIStatusError as error:
        return {"reward": 1.0, "metrics": {"status": error.status_code}}
    return 1.0
"""


def test_aborting_a_replicas_program_groups_ends_their_episodes_and_drops_them(setup, tmp_path):
    """A replica's shutdown (``abort_all``) while a program waits on its request: the request is
    aborted, the episode finishes with ``abort`` at once and the group is dropped."""
    root, tokenizer, dataset, model = setup
    (tmp_path / "stuck.py").write_text(STUCK)
    engine = engine_of(model)
    engine.pause("keep")  # nothing generates: the request surely waits in the engine
    agents = AgentRollout(AgentConfig(name="program", program=str(tmp_path / "stuck.py")), tokenizer, engine)
    tracker = GroupTracker(replica=0, writer=InlineWriter(), agents=agents)
    try:
        tracker.start(engine, groups_of([{"marker": "<p0>"}], tokenizer))
        deadline = time.monotonic() + 60
        running = agents.program.running
        while not (len(running) == N and all(e.in_engine for e in list(running.values()))):
            assert time.monotonic() < deadline, "the episodes' requests never reached the engine"
            time.sleep(0.01)
        episodes = [pending.futures for pending in tracker._pending.values()][0]
        assert tracker.abort_all(engine) == 1
        trajectories = [future.result(timeout=30) for future in episodes]
        assert [t.finish_reason for t in trajectories] == ["abort"] * N
        assert tracker.collect(wait_s=1.0) == [] and tracker.in_flight == 0
        assert agents.program.running == {} and agents.program.aborted == set()
    finally:
        engine.resume()
        agents.close()
        engine.close()


def test_the_endpoint_keeps_only_the_last_ended_keys(setup):
    """Ended episodes' keys answer 409 while they are among the last ``ended_kept``; older ones are
    forgotten (401, unknown), so a long run's endpoint holds a bounded set."""
    root, tokenizer, dataset, model = setup
    engine = engine_of(model)
    try:
        endpoint = ProgramEndpoint(engine, tokenizer, None)
        endpoint.ended_kept = 3
        episodes = []
        for i in range(5):
            record = EpisodeRecord(TurnEncoder(tokenizer), tokenizer.eos_token_id, 8, 16)
            episodes.append(endpoint.open(f"e{i}", record, agent_config(root, "function").program_limits,
                                          sampling(tokenizer), i))  # fmt: skip
        for episode in episodes:
            endpoint.close(episode)
        assert list(endpoint.ended) == [e.key for e in episodes[2:]] and endpoint.episodes == {}
        client = TestClient(endpoint.app)
        body = {"model": "any", "messages": [{"role": "user", "content": "x"}]}
        statuses = [
            client.post(
                "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {e.key}"}
            ).status_code
            for e in episodes
        ]
        assert statuses == [401, 401, 409, 409, 409]
    finally:
        engine.close()


def test_program_metrics_are_averaged_over_the_episodes_that_returned_them():
    metrics = episode_metrics(
        [1, 2, 2], [0, 0, 0], [0, 0, 0], ["stop", "program_error", "stop"], [],
        program_splits=[0, 0, 1], program_metrics=[{"a": 1.0, "b": 4.0}, {}, {"a": 2.0}],
    )  # fmt: skip
    assert metrics["agent/program/metric/a"] == 1.5 and metrics["agent/program/metric/b"] == 4.0
    assert metrics["agent/program/errors"] == 1.0 and metrics["agent/program/splits"] == 1.0


RUN_PROGRAM = """
import asyncio


async def run(client, row):
    if row["seed"] % 3 == 0:
        raise RuntimeError("the agent crashed")
    messages = list(row["messages"])
    for turn in range(2):
        reply = await client.chat.completions.create(model="any", messages=messages, max_tokens=4)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "again"})
    answer = messages[-2]["content"]
    return {"reward": sum(c.isdigit() for c in answer) / max(len(answer), 1), "metrics": {"requests": 2}}
"""

RUN_COMMAND = """
import json, sys
from openai import OpenAI

row = json.load(sys.stdin)
if row["seed"] % 3 == 0:
    sys.exit(3)
client, messages = OpenAI(max_retries=0), list(row["messages"])
for turn in range(2):
    reply = client.chat.completions.create(model="any", messages=messages, max_tokens=4)
    messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "again"})
answer = messages[-2]["content"]
print(json.dumps({"reward": sum(c.isdigit() for c in answer) / max(len(answer), 1), "metrics": {"requests": 2}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
@pytest.mark.parametrize("kind", ["function", "command"])
def test_grpo_trains_a_program_agent_in_the_asynchronous_pipelines(rl_files, tmp_path, mode, kind):
    """Two GRPO steps with the episodes on a rollout replica: the trainer's log-probs equal the
    rollout's on the steps sampled with the trainer's weights, a third of the episodes fail (reward
    0, counted) and the run goes on, and the programs' metrics are logged. In fully async, the
    validation before training runs its episodes on the replica too."""
    from tandem.rl.trainer import RLTrainer
    from tests.rl.conftest import small_config

    (tmp_path / "agent.py").write_text(RUN_PROGRAM if kind == "function" else RUN_COMMAND)
    program = (
        f"agent.program={tmp_path / 'agent.py'}"
        if kind == "function"
        else f"agent.program_command=[{sys.executable},{tmp_path / 'agent.py'}]"
    )
    config = small_config(
        rl_files, tmp_path / "run", "agent.name=program", program, "reward.sources=[interaction]",
        "rollout.max_response_length=40", f"trainer.val_before_train={mode == 'fully_async'}",
        "trainer.val_every=0", f"pipeline.mode={mode}", "pipeline.trainer_threads=1",
        "pipeline.rollout_threads=1",
    )  # fmt: skip
    result = RLTrainer(config).fit()
    history = [entry for entry in result.history if "agent/turns/mean" in entry]  # the training steps
    assert len(history) == 2
    if mode == "fully_async":  # two-request validation episodes (or failed ones, with no tokens)
        assert result.validation["val-aux/response_length/mean"] > 0
    assert history[0]["pipeline/staleness/max"] == 0
    for entry in history:
        if entry["pipeline/staleness/max"] == 0:  # sampled with the trainer's weights
            assert entry["rollout_corr/max_abs_log_prob_diff"] <= 1e-5
        assert entry["agent/program/errors"] == 16 * entry["agent/finish/program_error"]
        assert entry["agent/program/metric/requests"] == 2.0 and entry["agent/program/splits"] == 0
        assert entry["agent/turns/mean"] > 1.0
    assert sum(entry["agent/program/errors"] for entry in history) >= 1
