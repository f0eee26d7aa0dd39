"""Tool calls the model makes, end to end: a command program (a real subprocess with the real
``openai`` client) answers each call with a ``tool`` message, for 1-, 2- (streamed) and 5-turn
episodes, and the rows train exactly what was sampled.

A tiny random model writes no ``<tool_call>`` blocks, so the endpoint reads its replies with a
user's tool-call parser that takes every reply as one ``lookup`` call of what it says: every turn
comes back as ``tool_calls`` (``finish_reason`` ``tool_calls``), the program echoes it as the
client dumps it and adds the tool's result, and the next request continues the row.

The references: the token ids the endpoint returned to the subprocess (it writes them to a file)
against the training row's model tokens, the number of calls the program saw against its turns,
each episode's marker (in its tool results) against the text its row decodes to, and the
trainer's fp32 log-probs against the rollout's."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")

from tandem.agents.config import AgentConfig  # noqa: E402
from tandem.agents.loops import PROGRAM_ERROR  # noqa: E402
from tandem.agents.rollout import AgentRollout  # noqa: E402
from tandem.agents.tool_calls import ParsedTurn, ToolCall  # noqa: E402
from tests.agents.test_program_agent import engine_setup, prompts, row_tokens, sampling, trainer_log_probs  # noqa: E402

CALLING_AGENT = """
import json, sys
from openai import OpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
row = json.load(sys.stdin)
info = row["extra_info"]
client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
messages, sampled, calls = list(row["messages"]), [], 0
for turn in range(info["turns"]):
    ask = {"model": "any", "messages": messages, "max_tokens": 6, "tools": TOOLS}
    if info["stream"]:
        state, ids = ChatCompletionStreamState(input_tools=TOOLS), []
        for chunk in client.chat.completions.create(stream=True, **ask):
            state.handle_chunk(chunk)
            ids += [t for c in chunk.choices for t in c.model_extra["token_ids"]]
        choice = state.get_final_completion().choices[0]
    else:
        choice = client.chat.completions.create(**ask).choices[0]
        ids = choice.model_extra["token_ids"]
    assert choice.finish_reason == "tool_calls", choice
    sampled.append(ids)
    messages.append(choice.message.model_dump(exclude_none=True, exclude={"parsed"}))
    for call in choice.message.tool_calls:
        calls += 1
        messages.append({"role": "tool", "tool_call_id": call.id, "content": info["marker"] + " found"})
json.dump({"sampled": sampled, "calls": calls}, open(info["log"], "w"))
print(float(calls))
"""


def every_reply_calls(text: str) -> ParsedTurn:
    """A user's tool-call parser: every reply is one ``lookup`` call of what it says."""
    return ParsedTurn("", [ToolCall("lookup", {"said": text})])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with engine_setup(tmp_path_factory.mktemp("calls"), {"calling_agent.py": CALLING_AGENT}) as made:
        yield made


def test_one_two_and_five_turns_of_tool_calls_in_a_subprocess_train_exactly_the_sampled_tokens(
    setup, tmp_path
):
    root, tokenizer, engine, model = setup
    rows = [
        {"marker": f"[t{i}]", "turns": turns, "stream": turns == 2, "log": str(tmp_path / f"{i}.json")}
        for i, turns in enumerate([1, 2, 5])
    ]
    batch, width = prompts(rows, tokenizer)
    command = (sys.executable, str(root / "calling_agent.py"))
    agents = AgentRollout(AgentConfig(name="program", program_command=command), tokenizer, engine)
    agents.program.endpoint.parser = every_reply_calls  # the parser a user's agent.tool_parser names
    try:
        out = agents.generate(batch, sampling(tokenizer, 240), width, 0)
    finally:
        agents.close()
    mask = out["response_mask"].bool()
    for i, row in enumerate(rows):
        assert out["finish_reason"][i] != PROGRAM_ERROR, out["agent_program_log"][i]
        log = json.loads(Path(row["log"]).read_text())
        assert log["calls"] == row["turns"] == len(log["sampled"]) and out["agent_reward"][i] == row["turns"]
        # the trained tokens are the sampled ones, exactly, in order: each echoed call continued the row
        assert out["responses"][i][mask[i]].tolist() == [t for turn in log["sampled"] for t in turn]
        assert out["agent_program_splits"][i] == 0
        # between the turns, the template's tool turns with this episode's results (none after the last)
        assert tokenizer.decode(row_tokens(out, i)).count(row["marker"]) == row["turns"]
    diff = (trainer_log_probs(model, out) - out["rollout_log_probs"])[mask]
    assert diff.numel() >= 8 and diff.abs().max() <= 1e-5, float(diff.abs().max())
