"""Every agent-program fault on a rollout replica (``pipeline.mode=one_step_off|fully_async``):
each episode of one step gets a different fault by row, on the replica's
:class:`~tandem.pipeline.groups.GroupTracker`, assembled by
:func:`~tandem.pipeline.runner.assemble_batch`.

The reference: the sync path (:meth:`~tandem.agents.rollout.AgentRollout.generate`) on the same
rows, run at the same time on the same engine: each row's finish reason, reward and fault (its
``agent_program_log["error"]``) and the step's ``agent/program/errors`` are equal; what the program
was told (the status and message its client got, logged by the program itself) says which limit;
the faultless row trains exactly the tokens it was sent."""

import json
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from tandem.agents.config import AgentConfig  # noqa: E402
from tandem.agents.loops import PROGRAM_ERROR, batch_episode_metrics  # noqa: E402
from tandem.agents.rollout import AgentRollout  # noqa: E402
from tandem.models import load_tokenizer  # noqa: E402
from tandem.pipeline.groups import EpisodePrompt, GroupRequest, GroupTracker  # noqa: E402
from tandem.pipeline.runner import assemble_batch  # noqa: E402
from tandem.pipeline.sample_store import InlineWriter  # noqa: E402
from tandem.rl.data import RLDataset  # noqa: E402
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, SamplingParams  # noqa: E402
from tests.agents.test_program_agent import FAULTS as FUNCTION  # noqa: E402
from tests.agents.test_program_agent import prompts  # noqa: E402
from tests.agents.test_program_async import collect_all  # noqa: E402

COMMAND = """
import json, os, sys, time, urllib.error, urllib.request

row = json.load(sys.stdin)
info, messages = row["extra_info"], row["messages"]
fault, key = info["fault"], os.environ["OPENAI_API_KEY"]
json.dump({"key": key}, open(info["log"], "w"))


def ask(messages, **extra):
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "any", "messages": messages, **extra}).encode(),
        headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"},
    )
    return json.load(urllib.request.urlopen(request))


try:
    if fault == "crash":
        raise RuntimeError("the agent crashed")
    if fault == "exit":
        print(0.5)
        sys.exit(3)
    if fault == "hang":
        time.sleep(60)
    if fault == "flood":
        sys.stdout.write("x" * 5000)
        sys.stdout.flush()
        time.sleep(60)
    if fault == "garbled":
        print("reward: a lot")
        sys.exit(0)
    if fault == "malformed":
        ask([{"role": "robot", "content": "x"}])
    if fault == "max_requests":
        for _ in range(3):
            ask(messages, max_tokens=2)
    if fault == "max_tokens":
        for _ in range(2):
            ask(messages, max_tokens=20)
    if fault == "none":
        sampled = ask(messages, max_tokens=4)["choices"][0]["token_ids"]
        json.dump({"key": key, "sampled": sampled}, open(info["log"], "w"))
except urllib.error.HTTPError as error:
    message = json.loads(error.read())["error"]["message"]
    json.dump({"key": key, "status": error.code, "message": message}, open(info["log"], "w"))
print(1.0)
"""

LIMITS = {
    "program_timeout_s": 1.5,
    "program_max_requests": 2,
    "program_max_tokens": 4,
    "program_output_bytes": 2048,
}
FAULTS = {  # per kind: fault -> what its row's error says (empty: none)
    "function": {
        "none": "",
        "raise": "raised RuntimeError",
        "hang": "did not return within 1.5 s (agent.program_timeout_s)",
        "malformed": "made a request that was refused (HTTP 400: a malformed request",
        "max_requests": "made a request that was refused (HTTP 400: this episode has made its 2 requests",
        "max_tokens": "made a request that was refused (HTTP 400: this episode has no tokens left under "
        "agent.program_max_tokens",
        "bad_return": "returned a reward that is",
    },
    "command": {
        "none": "",
        "crash": "exited with status 1",
        "exit": "exited with status 3",
        "hang": "did not exit within 1.5 s (agent.program_timeout_s); its process group was killed",
        "flood": "wrote more than 2048 bytes to stdout (agent.program_output_bytes)",
        "garbled": "printed 'reward: a lot' as its last line of stdout",
        "malformed": "made a request that was refused (HTTP 400: a malformed request",
        "max_requests": "made a request that was refused (HTTP 400: this episode has made its 2 requests",
        "max_tokens": "made a request that was refused (HTTP 400: this episode has no tokens left under "
        "agent.program_max_tokens",
    },
}
TOLD = {  # fault -> (the status the program's client got, what its message names)
    "malformed": (400, "messages.0.role"),
    "max_requests": (400, "agent.program_max_requests"),
    "max_tokens": (400, "agent.program_max_tokens"),
}


def agent_config(root: Path, kind: str) -> AgentConfig:
    if kind == "function":
        return AgentConfig(name="program", program=str(root / "faults.py"), **LIMITS)
    return AgentConfig(
        name="program", program_command=(sys.executable, str(root / "faults_cli.py")), **LIMITS
    )


def sync_reference(
    agents: AgentRollout, rows: list[dict], params: SamplingParams, tokenizer, out: dict
) -> None:
    """The sync path's batch of ``rows`` (seeds 7, 8, ...), into ``out["batch"]``."""
    batch, width = prompts(rows, tokenizer)
    out["batch"] = agents.generate(batch, params, width, 0)


@pytest.mark.parametrize("kind", ["function", "command"])
def test_every_fault_on_a_replica_is_counted_and_scores_zero_as_in_the_sync_path(rl_files, tmp_path, kind):
    """One step of one-episode groups, a fault each (and one without): on the replica's tracker each
    faulty row finishes with ``program_error``, reward 0 and the sync path's reason, every group
    reaches the batch (none ends the run), ``agent/program/errors`` equals the sync path's, and an
    ended episode's key is refused (409) with a message its client shows."""
    (tmp_path / "faults.py").write_text(FUNCTION)
    (tmp_path / "faults_cli.py").write_text(COMMAND)
    tokenizer = load_tokenizer(rl_files["model"])
    dataset = RLDataset.load(rl_files["train"], tokenizer, 64)
    faults = list(FAULTS[kind])
    params = SamplingParams(temperature=1.0, max_tokens=40, stop_token_ids=(tokenizer.eos_token_id,))

    def rows(path: str) -> list[dict]:
        (tmp_path / path).mkdir()
        return [{"marker": f"<f{g}>", "fault": f, "log": str(tmp_path / path / f"{f}.json")}
                for g, f in enumerate(faults)]  # fmt: skip

    replica_rows, sync_rows = rows("replica"), rows("sync")
    groups = [
        GroupRequest(f"g{g}", g, (), (7 + g,), params,
                     EpisodePrompt(({"role": "user", "content": f"{row['marker']} start"},), row))
        for g, row in enumerate(replica_rows)
    ]  # fmt: skip
    engine = NativeRolloutEngine.from_pretrained(
        rl_files["model"], NativeEngineConfig(max_num_seqs=32, max_model_len=256)
    )
    replica_agents = AgentRollout(agent_config(tmp_path, kind), tokenizer, engine)
    sync_agents = AgentRollout(agent_config(tmp_path, kind), tokenizer, engine)
    tracker = GroupTracker(replica=0, writer=InlineWriter(), agents=replica_agents)
    reference: dict = {}
    sync = threading.Thread(
        target=sync_reference, args=(sync_agents, sync_rows, params, tokenizer, reference)
    )
    try:
        tracker.start(engine, groups)
        sync.start()  # the same rows at the same time: the two hangs overlap
        metas = collect_all(tracker, len(groups))
        sync.join(timeout=60)
        base_url = replica_agents.program.base_url
        ended = [json.loads(Path(row["log"]).read_text())["key"] for row in replica_rows]
        client = openai.OpenAI(base_url=base_url, api_key=ended[0], max_retries=0)
        with pytest.raises(openai.ConflictError, match="this episode has ended"):
            client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}])
    finally:
        replica_agents.close()
        sync_agents.close()
        engine.close()
    batch, expected = assemble_batch(metas, dataset, 1, tokenizer.pad_token_id), reference["batch"]
    assert len(batch) == len(faults) and len(set(ended)) == len(faults)  # every group, its own key
    for g, fault in enumerate(faults):
        error = batch["agent_program_log"][g]["error"]
        assert error == expected["agent_program_log"][g]["error"], (fault, error)
        assert batch["finish_reason"][g] == expected["finish_reason"][g], fault
        assert batch["agent_reward"][g] == expected["agent_reward"][g], fault
        if fault == "none":
            assert (
                error == "" and batch["agent_reward"][g] == 1.0 and batch["finish_reason"][g] != PROGRAM_ERROR
            )
            sampled = json.loads(Path(replica_rows[g]["log"]).read_text())["sampled"]
            assert batch["responses"][g][batch["response_mask"][g].bool()].tolist() == sampled
            continue
        assert FAULTS[kind][fault] in error, (fault, error)
        assert batch["finish_reason"][g] == PROGRAM_ERROR and batch["agent_reward"][g] == 0.0, fault
        if fault in TOLD:  # what the program's own client was told
            told = json.loads(Path(replica_rows[g]["log"]).read_text())
            assert told["status"] == TOLD[fault][0] and TOLD[fault][1] in told["message"], (fault, told)
    if kind == "command":
        assert batch["agent_program_log"][faults.index("flood")]["stdout"] == "x" * 2048
    errors = batch_episode_metrics(batch, lambda: [])["agent/program/errors"]
    assert errors == batch_episode_metrics(expected, lambda: [])["agent/program/errors"] == len(faults) - 1


LEAVES_A_REQUEST = """
import asyncio, os


async def run(client, row):
    gate, stream = row["extra_info"]["gate"], row["extra_info"]["stream"]
    request = asyncio.ensure_future(
        client.chat.completions.create(model="any", messages=row["messages"], stream=stream)
    )
    while not os.path.exists(gate):  # until the test has seen the request in the engine
        await asyncio.sleep(0.01)
    return 1.0  # without awaiting it
"""


@pytest.mark.parametrize("stream", [False, True])
def test_a_program_that_returns_while_its_request_generates_is_a_fault(rl_files, tmp_path, stream):
    """The program returns while its request (streamed or not) waits in the (paused) engine: the
    request is aborted, the episode is a fault (reward 0, counted), whatever the program returned,
    and nothing of that request is recorded; the same outcome however the client's closing races
    the end."""
    (tmp_path / "leaves.py").write_text(LEAVES_A_REQUEST)
    tokenizer = load_tokenizer(rl_files["model"])
    dataset = RLDataset.load(rl_files["train"], tokenizer, 64)
    params = SamplingParams(temperature=1.0, max_tokens=40, stop_token_ids=(tokenizer.eos_token_id,))
    engine = NativeRolloutEngine.from_pretrained(
        rl_files["model"], NativeEngineConfig(max_num_seqs=8, max_model_len=256)
    )
    agents = AgentRollout(AgentConfig(name="program", program=str(tmp_path / "leaves.py")), tokenizer, engine)
    tracker = GroupTracker(replica=0, writer=InlineWriter(), agents=agents)
    gate = tmp_path / "gate"
    prompt = EpisodePrompt(({"role": "user", "content": "start"},), {"gate": str(gate), "stream": stream})
    engine.pause("keep")  # nothing generates: the request surely waits in the engine
    try:
        tracker.start(engine, [GroupRequest("g0", 0, (), (3,), params, prompt)])
        deadline, running = time.monotonic() + 60, agents.program.running
        while not any(episode.in_engine for episode in list(running.values())):
            assert time.monotonic() < deadline, "the program's request never reached the engine"
            time.sleep(0.01)
        gate.touch()
        (meta,) = collect_all(tracker, 1)
        assert engine.num_running == 0 and not engine.metrics().waiting  # the request was aborted
    finally:
        engine.resume()
        agents.close()
        engine.close()
    batch = assemble_batch([meta], dataset, 1, tokenizer.pad_token_id)
    assert batch["finish_reason"][0] == PROGRAM_ERROR and batch["agent_reward"][0] == 0.0
    assert "ended with 1 request still being answered" in batch["agent_program_log"][0]["error"]
    assert int(batch["response_mask"][0].sum()) == 0
    assert batch_episode_metrics(batch, lambda: [])["agent/program/errors"] == 1.0


RUN_FAULTS = """
import asyncio, os
import openai

FAULTS = ["none", "raise", "hang", "malformed", "max_requests", "max_tokens", "bad_return"]


async def run(client, row):
    fault, messages = FAULTS[row["seed"] % len(FAULTS)], row["messages"]
    open(os.path.join(os.path.dirname(__file__), "seen", f"{row['seed']}.{fault}"), "w").close()
    if fault == "raise":
        raise RuntimeError("the agent crashed")
    if fault == "hang":
        await asyncio.sleep(60)
    if fault == "bad_return":
        return "a lot"
    try:
        if fault == "malformed":
            await client.chat.completions.create(model="any", messages=[{"role": "robot", "content": "x"}])
        asked = 20 if fault == "max_tokens" else 2  # the episode's tokens: 6 in all
        for _ in range({"max_requests": 3, "max_tokens": 2}.get(fault, 1)):
            await client.chat.completions.create(model="any", messages=messages, max_tokens=asked)
    except openai.APIStatusError:
        pass
    return 1.0
"""


@pytest.mark.slow
def test_a_fully_async_run_with_every_fault_finishes_its_steps(rl_files, tmp_path):
    """Two fully asynchronous GRPO steps whose episodes fault by seed (every kind above but the
    command-only ones, which the default-tier test runs on a replica): the run finishes both
    steps, each step counts its faults (``agent/program/errors`` = its episodes finishing with
    ``program_error``), every kind occurred, and the steps sampled with the trainer's weights
    have the rollout's log-probs (the fast sibling: the default-tier test above)."""
    from tandem.rl.trainer import RLTrainer
    from tests.rl.conftest import small_config

    (tmp_path / "agent.py").write_text(RUN_FAULTS)
    (tmp_path / "seen").mkdir()
    config = small_config(
        rl_files, tmp_path / "run", "agent.name=program", f"agent.program={tmp_path / 'agent.py'}",
        "reward.sources=[interaction]", "rollout.max_response_length=40", "trainer.val_before_train=false",
        "trainer.val_every=0", "pipeline.mode=fully_async", "pipeline.trainer_threads=1",
        "pipeline.rollout_threads=1", "agent.program_timeout_s=2", "agent.program_max_requests=2",
        "agent.program_max_tokens=6",
    )  # fmt: skip
    history = [e for e in RLTrainer(config).fit().history if "agent/turns/mean" in e]
    assert len(history) == 2
    for entry in history:
        assert entry["agent/program/errors"] == 16 * entry["agent/finish/program_error"]
        if entry["pipeline/staleness/max"] == 0:
            assert entry["rollout_corr/max_abs_log_prob_diff"] <= 1e-5
    assert sum(entry["agent/program/errors"] for entry in history) >= 1
    kinds = {path.suffix[1:] for path in (tmp_path / "seen").iterdir()}
    assert kinds == {"none", "raise", "hang", "malformed", "max_requests", "max_tokens", "bad_return"}, kinds


class HeldSubmissions:
    """The real engine, each submission held until ``release`` is set (``entered`` says one is
    waiting): a stand-in for the timing only, to end an episode while its request is being
    submitted (a replica's shutdown racing a request)."""

    def __init__(self, engine: NativeRolloutEngine) -> None:
        self.engine, self.entered, self.release = engine, threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def submit(self, request, **options):
        self.entered.set()
        assert self.release.wait(30)
        return self.engine.submit(request, **options)


def test_an_episode_ended_while_its_request_is_submitted_leaves_nothing_in_the_engine(rl_files):
    """The episode ends (``close``, as a replica's shutdown does) after its request entered the
    endpoint's books but before the engine held it, so ``close`` had nothing to abort: the request
    is aborted once submitted and answered 409 at once (before, it waited in the paused engine
    until its timeout), and the engine holds nothing of it."""
    from starlette.testclient import TestClient

    from tandem.agents.program.config import ProgramLimits
    from tandem.agents.program.endpoint import ProgramEndpoint
    from tandem.agents.program.recorder import EpisodeRecord
    from tandem.agents.trajectory import TurnEncoder

    tokenizer = load_tokenizer(rl_files["model"])
    engine = NativeRolloutEngine.from_pretrained(
        rl_files["model"], NativeEngineConfig(max_num_seqs=8, max_model_len=256)
    )
    held = HeldSubmissions(engine)
    endpoint = ProgramEndpoint(held, tokenizer, None)
    record = EpisodeRecord(TurnEncoder(tokenizer), tokenizer.eos_token_id, 8, 40)
    params = SamplingParams(temperature=1.0, max_tokens=40)
    episode = endpoint.open("e0", record, ProgramLimits(), params, 0)
    body = {"model": "any", "messages": [{"role": "user", "content": "x"}]}
    answer: dict = {}

    def post() -> None:
        with TestClient(endpoint.app) as client:
            headers = {"Authorization": f"Bearer {episode.key}"}
            answer["response"] = client.post("/v1/chat/completions", json=body, headers=headers)

    engine.pause("keep")  # nothing generates: a request the engine holds would wait there
    poster = threading.Thread(target=post)
    try:
        poster.start()
        assert held.entered.wait(30)
        assert endpoint.close(episode) == 1  # the request was being answered, not yet in the engine
        held.release.set()
        poster.join(timeout=15)
        assert not poster.is_alive(), "the request waited in the engine after its episode ended"
        metrics = engine.metrics()
        assert metrics.waiting == 0 and metrics.running == 0
    finally:
        held.release.set()
        engine.resume()
        poster.join(timeout=30)
        engine.close()
    response = answer["response"]
    assert response.status_code == 409 and "ended while its request was generating" in response.text
    assert record.segments == [] and episode.in_engine == set()
