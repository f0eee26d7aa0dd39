"""Command-line agent programs (``agent.program_command``): one real subprocess per episode, with
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` in its environment, the row on stdin and its result on
the last line of stdout.

The references: the token ids the endpoint returned to the subprocess (it writes them to a file)
against the training row's model tokens, the trainer's log-probs against the rollout's, what each
program printed against the output kept on its row, each episode's marker against the text its
row decodes to, and for each fault the reason it must be given."""

import json
import logging
import os
import re
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from tandem.agents.config import AgentConfig  # noqa: E402
from tandem.agents.loops import PROGRAM_ERROR, episode_metrics  # noqa: E402
from tandem.agents.program.command import result_value  # noqa: E402
from tandem.agents.program.config import ProgramLimits, read_result  # noqa: E402
from tandem.agents.rollout import AgentRollout  # noqa: E402
from tandem.config.overrides import config_from_overrides  # noqa: E402
from tests.agents.test_program_agent import engine_setup, prompts, row_tokens, sampling, trainer_log_probs  # noqa: E402

OPENAI_AGENT = """
import json, os, sys
from openai import OpenAI

row = json.load(sys.stdin)
info = row["extra_info"]
client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
messages, sampled = list(row["messages"]), []
for turn in range(2):
    reply = client.chat.completions.create(model="any", messages=messages, max_tokens=6)
    sampled.append(reply.choices[0].model_extra["token_ids"])
    messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": f"{info['marker']} after turn {turn}"})
    print(f"turn {turn} done")
print("a note", file=sys.stderr)
with open(info["log"], "w") as log:
    json.dump({"sampled": sampled, "key": os.environ["OPENAI_API_KEY"]}, log)
print(info["result"])
"""

# stdlib only (no openai import: a fast start), two turns over urllib
STDLIB_AGENT = """
import json, os, sys, urllib.request

row = json.load(sys.stdin)
info = row["extra_info"]
messages, sampled = list(row["messages"]), []
for turn in range(2):
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "any", "messages": messages, "max_tokens": 5}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
    )
    choice = json.load(urllib.request.urlopen(request))["choices"][0]
    sampled.append(choice["token_ids"])
    messages += [choice["message"], {"role": "user", "content": info["marker"] + " again"}]
json.dump({"sampled": sampled, "key": os.environ["OPENAI_API_KEY"]}, open(info["log"], "w"))
print(json.dumps({"reward": 1.0, "metrics": {"turns": 2}}))
"""

FAULTS = """
import json, os, signal, subprocess, sys, time, urllib.error, urllib.request

row = json.load(sys.stdin)
info = row["extra_info"]
fault = info["fault"]
if fault == "none":
    print(0.75)
elif fault == "exit":
    print(0.5)
    sys.exit(3)
elif fault == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
elif fault == "garbled":
    print("reward: a lot")
elif fault == "bad_value":
    print(json.dumps({"reward": "high"}))
elif fault in ("stdout_flood", "stderr_flood"):
    stream = sys.stdout if fault == "stdout_flood" else sys.stderr
    stream.write("x" * 5000)
    stream.flush()
    time.sleep(60)
elif fault == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(info["log"], "w").write(str(child.pid))
    time.sleep(60)
elif fault == "refused":
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "any", "messages": [{"role": "robot", "content": "x"}]}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
    )
    try:
        urllib.request.urlopen(request)
    except urllib.error.HTTPError as error:
        print(error.code, file=sys.stderr)
    print(1.0)
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with engine_setup(tmp_path_factory.mktemp("command"), {"openai_agent.py": OPENAI_AGENT}) as made:
        yield made


def rollout_of(setup, command: list[str], **limits) -> AgentRollout:
    _, tokenizer, engine, _ = setup
    return AgentRollout(
        AgentConfig(name="program", program_command=tuple(command), **limits), tokenizer, engine
    )


def sampled_of(log_path: str) -> list[int]:
    return [t for turn in json.loads(Path(log_path).read_text())["sampled"] for t in turn]


def test_a_two_turn_command_trains_exactly_its_sampled_tokens_and_its_result_line_is_read(setup, tmp_path):
    """The real ``openai`` client in a subprocess, configured from its environment alone; one row
    prints its result as a number, the other as JSON."""
    root, tokenizer, engine, model = setup
    results = ["0.25", json.dumps({"reward": 0.5, "metrics": {"turns": 2}})]
    rows = [
        {"marker": f"[c{i}]", "log": str(tmp_path / f"{i}.json"), "result": result}
        for i, result in enumerate(results)
    ]
    batch, width = prompts(rows, tokenizer)
    agents = rollout_of(setup, [sys.executable, str(root / "openai_agent.py")])
    out = agents.generate(batch, sampling(tokenizer, 120), width, 0)
    agents.close()
    mask = out["response_mask"].bool()
    for i, row in enumerate(rows):
        assert out["responses"][i][mask[i]].tolist() == sampled_of(row["log"])
        assert tokenizer.decode(row_tokens(out, i)).count(row["marker"]) == 2  # its prompt's, its reply's
        assert out["finish_reason"][i] != PROGRAM_ERROR
        assert out["agent_program_log"][i] == {
            "error": "", "stdout": f"turn 0 done\nturn 1 done\n{row['result']}\n", "stderr": "a note\n",
        }  # fmt: skip
    assert list(out["agent_reward"]) == [0.25, 0.5]
    assert list(out["agent_program_metrics"]) == [{}, {"turns": 2}]
    keys = {json.loads(Path(row["log"]).read_text())["key"] for row in rows}
    assert len(keys) == 2 and os.environ.get("OPENAI_API_KEY") not in keys
    diff = (trainer_log_probs(model, out) - out["rollout_log_probs"])[mask]
    assert diff.numel() >= 2 * 2 and diff.abs().max() <= 1e-5, float(diff.abs().max())


def test_the_result_line_is_the_last_non_empty_line_as_a_number_or_json():
    assert read_result(result_value("thinking...\n0.25\n\n")).reward == 0.25
    parsed = read_result(result_value('log\n{"reward": 1, "metrics": {"turns": 3}}\n'))
    assert (parsed.reward, parsed.metrics) == (1.0, {"turns": 3.0})
    assert result_value("1e-3") == 0.001
    with pytest.raises(ValueError, match="not a finite number"):
        read_result(result_value("nan"))  # not JSON, but a number: refused as not finite
    with pytest.raises(ValueError, match="printed no result"):
        result_value("\n  \n")
    with pytest.raises(ValueError, match=re.escape("printed 'score: 1' as its last line")):
        result_value("0.5\nscore: 1")


def test_sixteen_concurrent_subprocess_episodes_never_mix(setup, tmp_path):
    root, tokenizer, engine, model = setup
    rows = [{"marker": f"<e{i:02d}>", "log": str(tmp_path / f"{i}.json")} for i in range(16)]
    batch, width = prompts(rows, tokenizer)
    agents = rollout_of(setup, [sys.executable, "-c", STDLIB_AGENT])
    out = agents.generate(batch, sampling(tokenizer, 60), width, 0)
    agents.close()
    assert PROGRAM_ERROR not in list(out["finish_reason"]), out["agent_program_log"]
    for i, row in enumerate(rows):
        text = tokenizer.decode(row_tokens(out, i))
        assert set(re.findall(r"<e\d\d>", text)) == {row["marker"]} and text.count(row["marker"]) == 2, text
        assert out["responses"][i][out["response_mask"][i].bool()].tolist() == sampled_of(row["log"])
    assert len({json.loads(Path(row["log"]).read_text())["key"] for row in rows}) == 16
    assert list(out["agent_program_metrics"]) == [{"turns": 2.0}] * 16


@pytest.mark.slow
def test_sixteen_concurrent_openai_client_subprocesses_never_mix(setup, tmp_path):
    """The fast test's sibling with the real ``openai`` client in each of the 16 subprocesses."""
    root, tokenizer, engine, model = setup
    rows = [{"marker": f"<o{i:02d}>", "log": str(tmp_path / f"{i}.json"), "result": "1.0"} for i in range(16)]
    batch, width = prompts(rows, tokenizer)
    agents = rollout_of(setup, [sys.executable, str(root / "openai_agent.py")])
    out = agents.generate(batch, sampling(tokenizer, 60), width, 0)
    agents.close()
    assert PROGRAM_ERROR not in list(out["finish_reason"]), out["agent_program_log"]
    for i, row in enumerate(rows):
        text = tokenizer.decode(row_tokens(out, i))
        assert set(re.findall(r"<o\d\d>", text)) == {row["marker"]} and text.count(row["marker"]) == 2, text
        assert out["responses"][i][out["response_mask"][i].bool()].tolist() == sampled_of(row["log"])
    assert list(out["agent_reward"]) == [1.0] * 16


EXPECTED_FAULTS = {  # the fault -> what its row's error and the log say
    "exit": "exited with status 3",
    "signal": "was killed by SIGTERM",
    "garbled": "printed 'reward: a lot' as its last line of stdout",
    "bad_value": "returned a reward that is",
    "stdout_flood": "wrote more than 2048 bytes to stdout (agent.program_output_bytes)",
    "stderr_flood": "wrote more than 2048 bytes to stderr (agent.program_output_bytes)",
    "hang": "did not exit within 2 s (agent.program_timeout_s); its process group was killed",
    "refused": "made a request that was refused (HTTP 400: a malformed request",
    "empty": "printed no result",
}


def test_each_command_fault_is_named_counted_and_scores_zero_while_the_others_go_on(setup, tmp_path, caplog):
    root, tokenizer, engine, model = setup
    faults = ["none", *EXPECTED_FAULTS, "exit"]  # "exit" twice: logged once, counted twice
    rows = [
        {"marker": f"[f{i}]", "fault": f, "log": str(tmp_path / f"{i}.log")} for i, f in enumerate(faults)
    ]
    batch, width = prompts(rows, tokenizer)
    agents = rollout_of(
        setup, [sys.executable, "-c", FAULTS], program_timeout_s=2.0, program_output_bytes=2048
    )
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tandem.agents.program.runner"):
        out = agents.generate(batch, sampling(tokenizer), width, 0)
    seconds = time.monotonic() - started
    agents.close()
    assert seconds < 10  # the floods were killed at the cap, the hang at its timeout, not later
    assert out["agent_reward"][0] == 0.75 and out["agent_program_log"][0]["error"] == ""
    for i, fault in enumerate(faults[1:], start=1):
        log = out["agent_program_log"][i]
        assert out["finish_reason"][i] == PROGRAM_ERROR and out["agent_reward"][i] == 0.0, fault
        assert EXPECTED_FAULTS[fault] in log["error"], (fault, log)
    by_fault = dict(zip(faults, out["agent_program_log"], strict=False))
    assert by_fault["stdout_flood"]["stdout"] == "x" * 2048  # the first bytes kept, the rest refused
    assert by_fault["stderr_flood"]["stderr"] == "x" * 2048
    assert by_fault["exit"]["stdout"] == "0.5\n" and by_fault["refused"]["stderr"] == "400\n"
    warnings = [r.getMessage() for r in caplog.records]
    for fault, message in EXPECTED_FAULTS.items():
        assert sum(message in w for w in warnings) == 1, (fault, warnings)
    metrics = episode_metrics(
        [1] * len(faults), [0] * len(faults), [0] * len(faults), out["finish_reason"], []
    )
    assert metrics["agent/program/errors"] == len(faults) - 1
    grandchild = int(Path(rows[faults.index("hang")]["log"]).read_text())
    assert not _alive(grandchild)  # the hang's whole process group was killed, its child too


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


def docs_command() -> str:
    """The command example of docs/agents.md's "Train an agent you already have"."""
    page = (Path(__file__).parents[2] / "docs" / "agents.md").read_text()
    (code,) = re.findall(r"```python\n( *# agent_cli\.py.*?) *```", page, re.DOTALL)
    return textwrap.dedent(code)  # the block sits in a list item


def test_the_docs_command_example_runs_and_its_rewards_are_its_conversations(setup, tmp_path):
    root, tokenizer, engine, model = setup
    (tmp_path / "agent_cli.py").write_text(docs_command())
    rows = [{"expression": f"{i}+{i}", "marker": f"{i}+{i}="} for i in range(2)]
    batch, width = prompts(rows, tokenizer)
    batch = batch.assign(
        non_tensors={"raw_prompt": [[{"role": "user", "content": f"{i}+{i}="}] for i in range(2)]}
    )
    agents = rollout_of(setup, [sys.executable, str(tmp_path / "agent_cli.py")])
    out = agents.generate(batch, sampling(tokenizer, 64), width, 0)
    agents.close()
    for i, (messages, reward, metrics) in enumerate(
        zip(out["agent_messages"], out["agent_reward"], out["agent_program_metrics"], strict=True)
    ):
        attempts = sum(m["role"] == "assistant" for m in messages)
        assert metrics == {"attempts": attempts} and out["finish_reason"][i] != PROGRAM_ERROR
        solved = messages[-1]["content"].strip() == str(2 * i)
        assert reward == ((1.0 - 0.5 * (attempts - 1)) if solved else 0.0)


def test_a_wrong_command_setting_is_an_error_naming_its_key(tmp_path):
    (tmp_path / "agent.py").write_text("async def run(client, row):\n    return 1.0\n")
    cases = {
        "agent.program_command='python agent.py' must be a non-empty list": {
            "name": "program", "program_command": "python agent.py",
        },
        "agent.program_command[0]='no-such-agent-binary' is not a program on PATH": {
            "name": "program", "program_command": ("no-such-agent-binary",),
        },
        "agent.program_command[0]='./missing/agent' is not an executable file": {
            "name": "program", "program_command": ("./missing/agent",),
        },
        "agent.program_command[1]='' must be a non-empty string": {
            "name": "program", "program_command": (sys.executable, ""),
        },
        "agent.program and agent.program_command are both set": {
            "name": "program", "program": str(tmp_path / "agent.py"), "program_command": (sys.executable,),
        },
        "agent.program_command is set but agent.name='single_turn'": {
            "program_command": (sys.executable,),
        },
        "agent.program_output_bytes": {
            "name": "program", "program_command": (sys.executable,), "program_output_bytes": 0,
        },
    }  # fmt: skip
    for message, fields in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            AgentConfig(**fields)
    config = config_from_overrides(
        RunConfig,
        ["agent.name=program", "agent.program_command=[python,a.py]", "agent.program_output_bytes=99"],
    ).agent  # as the command line writes it
    assert config.program_command == ("python", "a.py") and config.enabled
    assert config.program_limits == ProgramLimits(600.0, 32, 8192, 99)


@dataclass
class RunConfig:
    agent: AgentConfig = field(default_factory=AgentConfig)


def test_a_command_program_is_an_interaction_reward_source_in_every_pipeline_mode(rl_files, tmp_path):
    from tests.rl.conftest import small_config

    command = f"agent.program_command=[{sys.executable},agent.py]"
    for mode in ("sync", "one_step_off", "fully_async"):
        config = small_config(
            rl_files, tmp_path / "run", "agent.name=program", command, "reward.sources=[interaction]",
            f"pipeline.mode={mode}",
        )  # fmt: skip
        assert config.agent.uses_program and list(config.reward.sources) == ["interaction"]
        assert config.pipeline.mode == mode
