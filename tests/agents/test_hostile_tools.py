"""Hostile tools and interactions (issue #42): whatever a user's tool or interaction function
does — recurse, hang, flood, return the wrong thing, raise ``SystemExit`` — the episode goes on
with an error in the tool turn (or ends with reward 0), counted in the metrics; and a broken
tools or interaction file is a one-line error before anything loads.

The reference for "the episode goes on" is the chat template: the trajectory's tokens must be
exactly the template's rendering of its conversation, error turns included, up to the answer.
"""

import json
import subprocess
import sys
import threading
import time

import pytest

from tandem.agents.config import AgentConfig
from tandem.agents.loops import AgentContext, AgentSample, agent_metrics, run_episodes
from tandem.agents.tool_calls import ToolCall, parse_hermes
from tandem.agents.tools import CALCULATOR, Tool, ToolRunner, tool_from_function
from tandem.cli import main
from tandem.models import load_tokenizer, save_tiny_model
from tandem.rollout import SamplingParams
from tests.agents.test_loops import ScriptedModel

NO_ARGUMENTS = {"type": "object", "properties": {}, "required": []}
RELEASE = threading.Event()  # set when the module's tests end: lets the hanging functions return


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    yield load_tokenizer(save_tiny_model(tmp_path_factory.mktemp("hostile") / "model"))
    RELEASE.set()


def call(name: str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {}}) + "</tool_call>"


def hang() -> str:
    RELEASE.wait(timeout=10.0)
    return "late"


def nothing():
    """A plain function that forgot to return."""


def leave() -> str:
    sys.exit(3)


def assert_tokens_render_the_conversation(tokenizer, trajectory) -> None:
    """The trajectory's context is the chat template's rendering of its messages (the reference)."""
    rendered = tokenizer.apply_chat_template(trajectory.messages, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert list(trajectory.context_ids) == rendered[: len(trajectory.context_ids)]
    assert len(rendered) - len(trajectory.context_ids) == 1  # ChatML's newline after the last turn


def run_tool_episode(tokenizer, tools, first_turn, **limits):
    """One episode: ``first_turn`` (a call), then the answer ``done``."""
    runner = ToolRunner(tools, concurrency=2, timeout_s=limits.pop("timeout_s", 60.0))
    model = ScriptedModel(tokenizer, [first_turn, "done"])
    ctx = AgentContext(
        model, tokenizer, SamplingParams(max_tokens=3000), "tool_agent", 4, runner, parse_hermes, **limits
    )
    started = time.perf_counter()
    (trajectory,) = run_episodes(ctx, [AgentSample([{"role": "user", "content": "hi"}], 0, "e0")])
    return trajectory, agent_metrics([trajectory], runner), time.perf_counter() - started


HOSTILE_TOOLS = {  # case: (the tool, the error the model receives)
    "returns None": (
        Tool("t", "d", NO_ARGUMENTS, lambda: None),
        "error: tool 't' returned NoneType, not text",
    ),
    "returns an int": (Tool("t", "d", NO_ARGUMENTS, lambda: 7), "error: tool 't' returned int, not text"),
    "forgets to return": (tool_from_function(nothing), "error: tool 'nothing' returned NoneType, not text"),
    "raises SystemExit": (tool_from_function(leave), "error: SystemExit: 3"),
    "hangs": (tool_from_function(hang), "error: tool 'hang' did not return within 0.3 s"),
}


@pytest.mark.parametrize("case", HOSTILE_TOOLS)
def test_a_hostile_tool_becomes_an_error_turn_and_the_episode_goes_on(tokenizer, case):
    tool, error = HOSTILE_TOOLS[case]
    trajectory, metrics, seconds = run_tool_episode(tokenizer, [tool], call(tool.name), timeout_s=0.3)
    assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == [error]
    assert trajectory.finish_reason == "stop" and trajectory.turns == 2  # it went on to its answer
    assert_tokens_render_the_conversation(tokenizer, trajectory)
    assert metrics["agent/tool/errors"] == 1.0 and metrics[f"agent/tool/{tool.name}/errors"] == 1.0
    assert seconds < 3.0  # a hanging tool holds the step for its time limit only


def test_a_tools_arguments_may_have_any_name_and_a_good_tool_is_untouched():
    """The call runs on a thread of its own; the arguments reach the tool as they were sent."""

    def echo(function: str, args: int, timeout_s: float) -> str:
        return f"{function} {args} {timeout_s}"

    runner = ToolRunner([tool_from_function(echo), CALCULATOR], timeout_s=5.0)
    calls = [
        ToolCall("echo", {"function": "f", "args": 2, "timeout_s": 0.5}),
        ToolCall("calculator", {"expression": "6*7"}),
    ]
    assert runner.run(calls) == ["f 2 0.5", "42"]
    assert runner.stats.metrics()["agent/tool/errors"] == 0.0
    runner.close()


def test_a_deeply_nested_call_is_an_error_not_a_recursion_error(tokenizer):
    deep = "<tool_call>" + "[" * 1000 + "</tool_call>"
    as_string = "<tool_call>" + json.dumps({"name": "calculator", "arguments": "[" * 1000}) + "</tool_call>"
    for text in (deep, as_string):
        turn = parse_hermes(text)
        assert turn.calls == [] and len(turn.errors) == 1 and "nested too deeply" in turn.errors[0]
    trajectory, metrics, _ = run_tool_episode(tokenizer, [CALCULATOR], deep)
    assert trajectory.finish_reason == "stop" and trajectory.turns == 2
    assert trajectory.messages[2]["content"].startswith("error: tool call 0: ")
    assert_tokens_render_the_conversation(tokenizer, trajectory)
    assert metrics["agent/tool/errors"] == 1.0


def test_a_flood_is_cut_before_it_is_tokenized(tokenizer):
    """3 MB of output: the head and tail are kept, the cut is said, and it takes no time."""
    flood = Tool("flood", "d", NO_ARGUMENTS, lambda: "<" + "x" * 3_000_000 + ">")
    trajectory, metrics, seconds = run_tool_episode(tokenizer, [flood], call("flood"), max_message_chars=200)
    (result,) = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert result.startswith("<" + "x" * 99) and result.endswith("x" * 99 + ">")
    assert "2999802 characters cut (agent.max_message_chars=200)" in result and len(result) < 300
    assert trajectory.finish_reason == "stop" and trajectory.turns == 2
    assert_tokens_render_the_conversation(tokenizer, trajectory)
    assert metrics["agent/tool/errors"] == 0.0 and seconds < 2.0


def good_interaction(messages, extra_info):
    return {"content": None, "done": True, "reward": 0.5}


def sleeping_interaction(messages, extra_info):
    RELEASE.wait(timeout=10.0)
    return {"content": None, "done": True, "reward": 1.0}


HOSTILE_INTERACTIONS = {  # case: the function
    "raises": lambda messages, extra_info: 1 / 0,
    "raises SystemExit": lambda messages, extra_info: sys.exit(1),
    "returns None": lambda messages, extra_info: None,
    "returns text": lambda messages, extra_info: "go on",
    "a non-numeric reward": lambda messages, extra_info: {"done": True, "reward": "high"},
    "a NaN reward": lambda messages, extra_info: {"done": True, "reward": float("nan")},
    "an infinite reward": lambda messages, extra_info: {"done": True, "reward": float("inf")},
    "a 400-digit reward": lambda messages, extra_info: {"done": True, "reward": 10**400},
    "content that is not text": lambda messages, extra_info: {"content": {"a": 1}, "done": False},
    "hangs": sleeping_interaction,
}


def run_interaction_episode(tokenizer, function):
    model = ScriptedModel(tokenizer, ["answer", "again"])
    ctx = AgentContext(
        model, tokenizer, SamplingParams(max_tokens=500), "interaction", 3,
        interaction=function, interaction_timeout_s=0.3,
    )  # fmt: skip
    started = time.perf_counter()
    (trajectory,) = run_episodes(ctx, [AgentSample([{"role": "user", "content": "hi"}], 0, "e0")])
    return trajectory, agent_metrics([trajectory]), time.perf_counter() - started


@pytest.mark.parametrize("case", HOSTILE_INTERACTIONS)
def test_a_hostile_interaction_ends_the_episode_with_reward_zero(tokenizer, case):
    reference, reference_metrics, _ = run_interaction_episode(tokenizer, good_interaction)
    assert (reference.finish_reason, reference.reward) == ("stop", 0.5)
    assert reference_metrics["agent/interaction/errors"] == 0.0

    trajectory, metrics, seconds = run_interaction_episode(tokenizer, HOSTILE_INTERACTIONS[case])
    assert (trajectory.finish_reason, trajectory.reward) == ("interaction_error", 0.0)
    assert trajectory.token_ids == reference.token_ids  # the same model turn, and nothing after it
    assert metrics["agent/interaction/errors"] == 1.0 and metrics["agent/finish/interaction_error"] == 1.0
    assert seconds < 3.0


# ---------------------------------------------------------------------------- broken files, up front
BROKEN_TOOLS = {  # file: the one-line error after "agent.tools_path='...'"
    "def lookup(city):\n    return city\nTOOLS = [lookup]\n": (
        ": TOOLS[0]: tool 'lookup': parameter 'city' needs a str, int, float or bool annotation"
    ),
    "TOOLS = [42]\n": ": TOOLS[0] is int 42, not a function or a Tool",
    "import no_such_module_here\n": ": line 1: ModuleNotFoundError: No module named 'no_such_module_here'",
    "def calculator(expression: str) -> str:\n    return expression\nTOOLS = [calculator]\n": (
        ": tools ['calculator'] are declared twice (in agent.tools and TOOLS)"
    ),
    "def a(x: str) -> str:\n    return x\nTOOLS = [a, a]\n": (
        ": tools ['a'] are declared twice (in agent.tools and TOOLS)"
    ),
    "from tandem.agents.tools import Tool\nTOOLS = [Tool('t', 'd', 'x', print)]\n": (
        ": line 2: ValueError: tool 't': parameters must be a JSON schema object (a dict), got str"
    ),
}

BROKEN_INTERACTIONS = {  # file: the one-line error after "agent.interaction_path='...'"
    "import no_such_module_here\n": ": line 1: ModuleNotFoundError: No module named 'no_such_module_here'",
    "respond = 3\n": " defines no function 'respond' (agent.interaction_name)",
    "def respond(messages):\n    return None\n": (
        ": function 'respond' (agent.interaction_name) must take two arguments (messages, extra_info)"
    ),
}


@pytest.mark.parametrize("source", BROKEN_TOOLS)
def test_a_broken_tools_file_is_named_when_the_config_is_built(tmp_path, source):
    path = tmp_path / "tools.py"
    path.write_text(source)
    with pytest.raises(ValueError) as caught:
        AgentConfig(name="tool_agent", tools=("calculator",), tools_path=str(path))
    assert str(caught.value) == f"agent.tools_path={str(path)!r}{BROKEN_TOOLS[source]}"


@pytest.mark.parametrize("source", BROKEN_INTERACTIONS)
def test_a_broken_interaction_file_is_named_when_the_config_is_built(tmp_path, source):
    path = tmp_path / "env.py"
    path.write_text(source)
    with pytest.raises(ValueError) as caught:
        AgentConfig(name="interaction", interaction_path=str(path))
    assert str(caught.value) == f"agent.interaction_path={str(path)!r}{BROKEN_INTERACTIONS[source]}"


def train_command(rl_files, output_dir, *overrides) -> list[str]:
    return [
        "train", f"model_path={rl_files['model']}", f"data.train_path={rl_files['train']}",
        "data.train_batch_size=4", "rollout.n=2", "trainer.total_steps=1", f"trainer.output_dir={output_dir}",
        *overrides,
    ]  # fmt: skip


def test_tandem_train_refuses_a_broken_tools_file_in_one_line_before_loading_anything(rl_files, tmp_path):
    """A real ``tandem train`` process: exit code 2, the one line, and no trainer ever started."""
    path = tmp_path / "tools.py"
    path.write_text("TOOLS = [42]\n")
    output_dir = tmp_path / "run"
    command = train_command(rl_files, output_dir, "agent.name=tool_agent", f"agent.tools_path={path}")
    finished = subprocess.run([sys.executable, "-m", "tandem", *command], capture_output=True, text=True)
    assert finished.returncode == 2, finished.stderr[-2000:]
    message = BROKEN_TOOLS["TOOLS = [42]\n"]
    assert finished.stderr == f"tandem train: error: agent.tools_path={str(path)!r}{message}\n"
    assert not output_dir.exists()  # the trainer never started: no model, no workers, no output


def test_tandem_train_refuses_a_broken_interaction_file_the_same_way(rl_files, tmp_path, capsys):
    """The same command line in this process (the subprocess above shows the path end to end)."""
    path = tmp_path / "env.py"
    path.write_text("import no_such_module_here\n")
    output_dir = tmp_path / "run"
    command = train_command(rl_files, output_dir, "agent.name=interaction", f"agent.interaction_path={path}")
    assert main(command) == 2
    message = BROKEN_INTERACTIONS["import no_such_module_here\n"]
    assert capsys.readouterr().err == f"tandem train: error: agent.interaction_path={str(path)!r}{message}\n"
    assert not output_dir.exists()
