"""Command programs in the OS sandbox (``agent.program_sandbox=true``): a real subprocess (stdlib
HTTP, or the real ``openai`` client in the slow tier) reaches its endpoint through the relay, and
nothing else.

The references: the token ids the endpoint returned to the sandboxed program (it prints them)
against the training row's model tokens; and the same program run unsandboxed, which does
reach the test's own listening TCP port on the host's loopback, the environment variable and
the file the sandboxed one cannot see."""

import json
import os
import socket
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from tandem.agents.config import AgentConfig  # noqa: E402
from tandem.agents.loops import PROGRAM_ERROR  # noqa: E402
from tandem.agents.rollout import AgentRollout  # noqa: E402
from tandem.agents.sandbox import sandbox_available  # noqa: E402
from tests.agents.test_program_agent import engine_setup, prompts, row_tokens, sampling  # noqa: E402

pytestmark = pytest.mark.skipif(bool(sandbox_available()), reason=f"no sandbox here: {sandbox_available()}")

OPENAI_TURNS = """
import json, os, socket, sys
from openai import OpenAI

row = json.load(sys.stdin)
info = row["extra_info"]
client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
messages, sampled = list(row["messages"]), []
for turn in range(2):
    reply = client.chat.completions.create(model="any", messages=messages, max_tokens=6)
    sampled.append(reply.choices[0].model_extra["token_ids"])
    messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": f"{info['marker']} again"})
"""

# stdlib only (a fast start): the same two turns over urllib
STDLIB_TURNS = """
import json, os, socket, sys, urllib.request

row = json.load(sys.stdin)
info = row["extra_info"]
messages, sampled = list(row["messages"]), []
for turn in range(2):
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "any", "messages": messages, "max_tokens": 6}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
    )
    choice = json.load(urllib.request.urlopen(request))["choices"][0]
    sampled.append(choice["token_ids"])
    messages += [choice["message"], {"role": "user", "content": info["marker"] + " again"}]
"""

PROBE = """
try:
    socket.create_connection(("127.0.0.1", info["port"]), timeout=2).close()
    reached = True
except OSError:
    reached = False
print(json.dumps({
    "sampled": sampled, "reached": reached, "secret": os.environ.get("TANDEM_TEST_SECRET"),
    "sees_file": os.path.exists(info["file"]),
}))
print(json.dumps({"reward": 1.0, "metrics": {"reached": float(reached)}}))
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with engine_setup(
        tmp_path_factory.mktemp("sandboxed"),
        {"openai_agent.py": OPENAI_TURNS + PROBE, "stdlib_agent.py": STDLIB_TURNS + PROBE},
    ) as made:
        yield made


@pytest.fixture
def listener():
    """A real TCP socket listening on the host's loopback, standing for any other local service."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        yield server


def accepted(server: socket.socket) -> bool:
    """Whether a connection is waiting (taken and closed)."""
    try:
        connection, _ = server.accept()
    except BlockingIOError:
        return False
    connection.close()
    return True


def run_probe(setup, tmp_path, port: int, sandbox: bool, agent: str = "stdlib_agent.py", episodes: int = 1):
    """``episodes`` concurrent episodes of ``agent``; their rows and what each program reported.
    Each row trains exactly the tokens its program was sent and decodes to its own conversation."""
    root, tokenizer, engine, _ = setup
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text("not for the program")
    rows = [{"marker": f"<s{i}>", "port": port, "file": str(secret_file)} for i in range(episodes)]
    batch, width = prompts(rows, tokenizer)
    config = AgentConfig(
        name="program", program_command=(sys.executable, str(root / agent)),
        program_sandbox=sandbox, program_timeout_s=60.0,
    )  # fmt: skip
    agents = AgentRollout(config, tokenizer, engine)
    try:
        out = agents.generate(batch, sampling(tokenizer, 120), width, 0)
    finally:
        agents.close()
    reports = []
    for i, row in enumerate(rows):
        log = out["agent_program_log"][i]
        assert out["finish_reason"][i] != PROGRAM_ERROR, log
        report = json.loads(log["stdout"].splitlines()[0])
        trained = out["responses"][i][out["response_mask"][i].bool()].tolist()
        assert trained == [t for turn in report["sampled"] for t in turn] and len(report["sampled"]) == 2
        assert tokenizer.decode(row_tokens(out, i)).count(row["marker"]) == 2  # its prompt's, its reply's
        reports.append(report)
    return out, reports


def test_sandboxed_commands_complete_their_episodes_and_reach_nothing_but_their_endpoint(
    setup, tmp_path, listener, monkeypatch
):
    monkeypatch.setenv("TANDEM_TEST_SECRET", "the run's own")
    port = listener.getsockname()[1]
    # the reference: unsandboxed, the same program reaches the port, the variable and the file
    _, (free,) = run_probe(setup, tmp_path, port, sandbox=False)
    assert free["reached"] and accepted(listener)
    assert free["secret"] == "the run's own" and free["sees_file"]
    out, reports = run_probe(setup, tmp_path, port, sandbox=True, episodes=3)  # three sandboxes at once
    assert (
        list(out["agent_reward"]) == [1.0] * 3
        and list(out["agent_program_metrics"]) == [{"reached": 0.0}] * 3
    )
    assert not accepted(listener)
    for boxed in reports:
        assert not boxed["reached"] and boxed["secret"] is None and not boxed["sees_file"]


@pytest.mark.slow
def test_the_openai_client_works_unchanged_in_the_sandbox(setup, tmp_path, listener):
    """The real ``openai`` client, configured by its environment alone, through the relay (slow:
    importing it takes seconds; the test above is its stdlib sibling)."""
    out, (boxed,) = run_probe(
        setup, tmp_path, listener.getsockname()[1], sandbox=True, agent="openai_agent.py"
    )
    assert out["agent_reward"][0] == 1.0 and not boxed["reached"] and not accepted(listener)


def command_lines_holding(text: str) -> list[str]:
    """The command lines of the host's processes that hold ``text``."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                line = Path(entry.path, "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if text in line:
                found.append(line)
    return found


def test_a_sandboxed_command_that_hangs_is_killed_at_its_timeout_with_all_it_started(setup):
    root, tokenizer, engine, _ = setup
    batch, width = prompts([{"marker": "[h]"}], tokenizer)
    sleep = "import time; time.sleep(61.25)"
    hang = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {sleep!r}]); {sleep}"
    config = AgentConfig(
        name="program", program_command=(sys.executable, "-c", hang), program_sandbox=True,
        program_timeout_s=1.0,
    )  # fmt: skip
    agents = AgentRollout(config, tokenizer, engine)
    out = agents.generate(batch, sampling(tokenizer), width, 0)
    agents.close()
    assert out["finish_reason"][0] == PROGRAM_ERROR and out["agent_reward"][0] == 0.0
    assert "did not exit within 1 s" in out["agent_program_log"][0]["error"]
    assert command_lines_holding("time.sleep(61.25)") == []  # the command and its child


def test_program_sandbox_needs_a_command():
    with pytest.raises(ValueError, match="agent.program_sandbox=true sandboxes agent.program_command"):
        AgentConfig(name="program", program=os.devnull, program_sandbox=True)


def test_a_sandboxed_command_sees_its_own_modules_only_when_mounted(setup, tmp_path):
    """A command whose script imports a module beside it: the sandbox shows only the script (the
    import fails, a counted fault) until ``agent.program_sandbox_mounts`` names its directory,
    read-only (a write there is refused)."""
    root, tokenizer, engine, _ = setup
    project = tmp_path / "agent_project"
    project.mkdir()
    (project / "helper.py").write_text("REWARD = 0.75\n")
    (project / "main.py").write_text(
        "import json, sys\nimport helper\n"
        "try:\n    open(__file__ + '.w', 'w').close(); wrote = 1.0\nexcept OSError:\n    wrote = 0.0\n"
        "print(json.dumps({'reward': helper.REWARD, 'metrics': {'wrote': wrote}}))\n"
    )
    batch, width = prompts([{"marker": "[m]"}], tokenizer)
    results = []
    for mounts in ((), (str(project),)):
        config = AgentConfig(
            name="program", program_command=(sys.executable, str(project / "main.py")),
            program_sandbox=True, program_sandbox_mounts=mounts, program_timeout_s=60.0,
        )  # fmt: skip
        agents = AgentRollout(config, tokenizer, engine)
        try:
            results.append(agents.generate(batch, sampling(tokenizer), width, 0))
        finally:
            agents.close()
    unmounted, mounted = results
    assert unmounted["finish_reason"][0] == PROGRAM_ERROR
    assert "No module named 'helper'" in unmounted["agent_program_log"][0]["stderr"]
    assert mounted["finish_reason"][0] != PROGRAM_ERROR, mounted["agent_program_log"][0]
    assert mounted["agent_reward"][0] == 0.75 and mounted["agent_program_metrics"][0] == {"wrote": 0.0}
    assert not (project / "main.py.w").exists()


def test_sandbox_mounts_are_checked_and_need_the_sandbox(tmp_path):
    command = (sys.executable, "-c", "print(1)")
    with pytest.raises(ValueError, match=r"agent.program_sandbox_mounts\[0\]='/nowhere' must name an existing"):
        AgentConfig(name="program", program_command=command, program_sandbox=True, program_sandbox_mounts=["/nowhere"])
    with pytest.raises(ValueError, match="agent.program_sandbox_mounts is set but agent.program_sandbox=false"):
        AgentConfig(name="program", program_command=command, program_sandbox_mounts=[str(tmp_path)])
