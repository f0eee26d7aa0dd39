"""The assistant message an agent program receives: the model's text, its tool calls in OpenAI's
``tool_calls`` form when the request offered ``tools``."""

from __future__ import annotations

import json
import uuid

from tandem.agents.tool_calls import ToolCallParser


def assistant_reply(text: str, parser: ToolCallParser | None) -> tuple[dict, bool]:
    """The message for ``text`` and whether it holds tool calls. With a ``parser`` (the request
    offered tools and did not say ``tool_choice="none"``) and well-formed calls, the calls come
    out of the content into ``tool_calls`` (``content`` keeps the prose, or None); a turn with a
    malformed call stays text, so the program sees what the model wrote."""
    turn = parser(text) if parser is not None else None
    if turn is None or not turn.calls or turn.errors:
        return {"role": "assistant", "content": text}, False
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for call in turn.calls
    ]
    return {"role": "assistant", "content": turn.text or None, "tool_calls": calls}, True
