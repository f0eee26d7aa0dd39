"""A streamed agent-program reply (``stream=true``): server-sent events in OpenAI's chunk form.

One chunk per sampled token (``token_ids``, ``weight_versions`` and, asked for, ``logprobs`` of
that token; the first chunk also carries ``role`` and ``prompt_token_ids``), then a last chunk
with the rest of the text and ``finish_reason``, the ``usage`` chunk when
``stream_options.include_usage``, and ``data: [DONE]``: ``tandem serve``'s stream
(:func:`~tandem.serve.openai_routes.stream_events`), built by the same
:class:`~tandem.serve.responses.ResponseBuilder`.

With ``n`` > 1 every chunk holds one choice, named by its ``index`` (what OpenAI's clients
accumulate by): the choices' token chunks interleave as they are sampled, each choice's first
chunk carries its ``role`` and ``prompt_token_ids``, and the last chunks (one per choice, in
choice order) come once every choice has finished, after the turn is recorded.

With a tool-call parser (the request offered ``tools``, ``tool_choice`` is not ``"none"``) the
text is held back until the turn ends, since a call can be parsed only whole: the token chunks
carry the ids and log-probs with empty ``content``, and the last chunk carries the prose (or
none) and the calls as ``delta.tool_calls`` entries (``index``, ``id``, ``type``, ``function``
with the whole ``arguments``), ``finish_reason`` ``tool_calls`` — what OpenAI's clients
accumulate into ``message.tool_calls``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from tandem.serve.responses import ChoiceState, ResponseBuilder

DONE = "data: [DONE]\n\n"


def event(body: dict) -> str:
    """One server-sent event holding ``body`` as JSON."""
    return f"data: {json.dumps(body)}\n\n"


def tool_call_deltas(calls: list[dict]) -> list[dict]:
    """OpenAI ``tool_calls`` as stream deltas: each call whole, with its ``index``."""
    return [{"index": i, **call} for i, call in enumerate(calls)]


def last_chunk(
    builder: ResponseBuilder, choice: ChoiceState, text: str, added: tuple, reply: dict, held: bool,
    finish_reason: str, first: bool,
) -> dict:  # fmt: skip
    """The chunk that ends a choice: ``text`` not sent yet and the tokens ``added`` at the end
    (normally none: each came in its own chunk); with ``held`` text (a tool-call parser), the
    reply's prose and its ``tool_calls`` instead."""
    content = (reply.get("content") or "") if held else text
    chunk = builder.chunk(choice, content, *added, finish_reason, first)
    if reply.get("tool_calls"):
        chunk["choices"][0]["delta"]["tool_calls"] = tool_call_deltas(reply["tool_calls"])
    return chunk


async def drain(queue: asyncio.Queue, turn: asyncio.Future) -> AsyncIterator[str]:
    """The events ``turn`` puts on ``queue`` until its ``None``; a reader that stops early
    (the client went away or stalled) cancels ``turn``, which aborts its generation."""
    try:
        while (item := await queue.get()) is not None:
            yield item
    finally:
        if not turn.done():
            turn.cancel()
