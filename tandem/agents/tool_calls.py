"""Tool-call parsers: the model's text of one turn -> its prose and the tool calls it made.

Parsers are registered by name in ``TOOL_CALL_PARSERS`` (``agent.tool_parser``). ``hermes``
reads the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks that Qwen and
Hermes chat templates teach, several per turn allowed. A block that is not valid JSON, or
lacks a string ``name`` or object ``arguments``, is not dropped: it becomes an error the agent
loop returns to the model as a tool message (and counts), so the model can learn to call well.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict


@dataclass
class ParsedTurn:
    """The turn's text without its tool-call blocks, the calls in order, and one message per
    block that could not be read as a call."""

    text: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


ToolCallParser = Callable[[str], ParsedTurn]
TOOL_CALL_PARSERS: Registry[ToolCallParser] = Registry("tool-call parser")

HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@TOOL_CALL_PARSERS.register("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    """``<tool_call>{json}</tool_call>`` blocks (an unclosed last block counts as malformed)."""
    turn = ParsedTurn(HERMES_BLOCK.sub("", text).strip())
    for number, match in enumerate(HERMES_BLOCK.finditer(text)):
        body = match.group(1).strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            turn.errors.append(f"tool call {number}: not valid JSON ({error.msg} at column {error.colno})")
            continue
        problem = _call_problem(call)
        if problem:
            turn.errors.append(f"tool call {number}: {problem}")
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models send the arguments as a JSON string
            arguments = json.loads(arguments)
        turn.calls.append(ToolCall(call["name"], arguments))
    if "<tool_call>" in HERMES_BLOCK.sub("", text):
        turn.errors.append("a <tool_call> block is not closed with </tool_call>")
    return turn


def _call_problem(call: object) -> str:
    """Why ``call`` is not ``{"name": str, "arguments": object}`` (empty when it is)."""
    if not isinstance(call, dict):
        return f"expected a JSON object with 'name' and 'arguments', got {type(call).__name__}"
    if not isinstance(call.get("name"), str) or not call["name"]:
        return "no tool 'name'"
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "'arguments' is a string that is not JSON"
    if not isinstance(arguments, dict):
        return f"'arguments' must be a JSON object, got {type(arguments).__name__}"
    return ""
