"""Tool-call parsers: the model's text of one turn -> its prose and the tool calls it made.

Parsers are registered by name in ``TOOL_CALL_PARSERS`` (``agent.tool_parser``). ``hermes``
reads the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks that Qwen and
Hermes chat templates teach, several per turn allowed. A block that is not valid JSON (or nests
too deeply to decode), or lacks a string ``name`` or object ``arguments``, is not dropped: it
becomes an error the agent loop returns to the model as a tool message (and counts), so the
model can learn to call well.
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
        value, problem = load_json(match.group(1).strip())
        call, problem = _read_call(value) if not problem else (None, problem)
        if call is None:
            turn.errors.append(f"tool call {number}: {problem}")
            continue
        turn.calls.append(call)
    if "<tool_call>" in HERMES_BLOCK.sub("", text):
        turn.errors.append("a <tool_call> block is not closed with </tool_call>")
    return turn


def load_json(text: str) -> tuple[object, str]:
    """``(value, "")`` for JSON text, ``(None, why)`` for text that is not JSON or nests too deeply
    to decode (Python's decoder recurses: ``[`` a thousand times raises ``RecursionError``)."""
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as error:
        return None, f"not valid JSON ({error.msg} at column {error.colno})"
    except RecursionError:
        return None, "JSON nested too deeply"


def _read_call(call: object) -> tuple[ToolCall | None, str]:
    """``call`` as a :class:`ToolCall` when it is ``{"name": str, "arguments": object}`` (the
    arguments may be a JSON string, as some models send them); else ``(None, why)``."""
    if not isinstance(call, dict):
        return None, f"expected a JSON object with 'name' and 'arguments', got {type(call).__name__}"
    if not isinstance(call.get("name"), str) or not call["name"]:
        return None, "no tool 'name'"
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        arguments, problem = load_json(arguments)
        if problem:
            return None, f"'arguments' is a string that is {problem}"
    if not isinstance(arguments, dict):
        return None, f"'arguments' must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(call["name"], arguments), ""
