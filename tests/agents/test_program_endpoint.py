"""The agent-program endpoint's request surface over real HTTP with the real ``openai`` client:
streamed replies (``stream=true``) and ``n``.

The references: the same request unstreamed under the same seed (its text, token ids, log-probs
and usage, each of its ``n`` choices, and what the recorder keeps of it) for a streamed one, as
the ``openai`` client's own stream accumulator (``ChatCompletionStreamState``) puts the chunks
together; and the unstreamed reply's ``tool_calls`` for the streamed tool-call deltas."""

import dataclasses
import json
import time

import pytest

openai = pytest.importorskip("openai")

from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402
from openai.types.chat import ChatCompletionChunk  # noqa: E402

from tandem.agents.program.config import ProgramLimits  # noqa: E402
from tandem.agents.program.endpoint import ProgramEndpoint  # noqa: E402
from tandem.agents.program.recorder import EpisodeRecord  # noqa: E402
from tandem.agents.program.replies import assistant_reply  # noqa: E402
from tandem.agents.program.streaming import last_chunk  # noqa: E402
from tandem.agents.tool_calls import ParsedTurn, ToolCall, parse_hermes  # noqa: E402
from tandem.agents.trajectory import Trajectory, TurnEncoder  # noqa: E402
from tandem.serve.launch import AppThread  # noqa: E402
from tandem.serve.responses import ChoiceState, ResponseBuilder  # noqa: E402
from tandem.serve.text import IncrementalText  # noqa: E402
from tests.agents.test_program_agent import engine_setup, sampling  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(tokenizer, endpoint, url)``: the endpoint over a tiny model's native engine, served."""
    with engine_setup(tmp_path_factory.mktemp("endpoint"), {}) as (_, tokenizer, engine, _model):
        endpoint = ProgramEndpoint(engine, tokenizer, parse_hermes)
        with AppThread(endpoint.app) as server:
            yield tokenizer, endpoint, server.url + "/v1"


def open_episode(served, seed: int, end_of_sequence_stops: bool = True):
    tokenizer, endpoint, url = served
    record = EpisodeRecord(TurnEncoder(tokenizer), tokenizer.eos_token_id, row_prompt=16, budget=400)
    params = sampling(tokenizer, 400)
    if not end_of_sequence_stops:  # every turn runs to its max_tokens
        params = dataclasses.replace(params, stop_token_ids=())
    episode = endpoint.open(f"episode-{seed}", record, ProgramLimits(), params, seed)
    return episode, openai.OpenAI(base_url=url, api_key=episode.key, max_retries=0)


def unstreamed_choices(client, messages, **extra) -> list[dict]:
    """Each choice of the reply: its message, text, token ids, log-probs, finish reason, and the
    request's usage."""
    reply = client.chat.completions.create(
        model="any", messages=messages, max_tokens=12, logprobs=True, **extra
    )
    return [
        {
            "message": choice.message.model_dump(exclude_none=True),
            "content": choice.message.content,
            "token_ids": choice.model_extra["token_ids"],
            "log_probs": [entry.logprob for entry in choice.logprobs.content],
            "finish_reason": choice.finish_reason,
            "usage": reply.usage.model_dump(),
        }
        for choice in reply.choices
    ]


def streamed_choices(client, messages, **extra) -> list[dict]:
    """The stream read chunk by chunk (each choice's ids and log-probs by the chunk's ``index``),
    and put together by the client's own accumulator."""
    state = ChatCompletionStreamState(input_tools=extra.get("tools", openai.NOT_GIVEN))
    token_ids, log_probs, usage = {}, {}, None
    for chunk in client.chat.completions.create(
        model="any", messages=messages, max_tokens=12, logprobs=True, stream=True,
        stream_options={"include_usage": True}, **extra,
    ):  # fmt: skip
        state.handle_chunk(chunk)
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            token_ids.setdefault(choice.index, []).extend(choice.model_extra["token_ids"])
            entries = choice.logprobs.content if choice.logprobs else []
            log_probs.setdefault(choice.index, []).extend(entry.logprob for entry in entries)
    choices = state.current_completion_snapshot.choices
    assert [choice.index for choice in choices] == list(range(len(choices))) == sorted(token_ids)
    return [
        {
            "message": choice.message.model_dump(exclude_none=True, exclude={"parsed"}),
            "content": choice.message.content,
            "token_ids": token_ids[choice.index],
            "log_probs": log_probs[choice.index],
            "finish_reason": choice.finish_reason,
            "usage": usage,
        }
        for choice in choices
    ]


def unstreamed(client, messages, **extra) -> dict:
    (choice,) = unstreamed_choices(client, messages, **extra)
    return choice


def streamed(client, messages, **extra) -> dict:
    (choice,) = streamed_choices(client, messages, **extra)
    return choice


def test_a_streamed_episode_gets_and_records_what_the_same_episode_unstreamed_does(served):
    """Two 2-turn episodes under one seed, one streamed: the replies (text, ids, log-probs, usage)
    are equal, and so are the recorded rows (tokens, log-probs, loss mask), turn for turn."""
    runs = {}
    for stream in (False, True):
        episode, client = open_episode(served, seed=11)
        messages, replies = [{"role": "user", "content": "hello there"}], []
        for turn in range(2):
            replies.append((streamed if stream else unstreamed)(client, messages))
            messages += [
                {"role": "assistant", "content": replies[-1]["content"]},
                {"role": "user", "content": f"and again {turn}"},
            ]
        served[1].close(episode)
        runs[stream] = replies, episode
    (plain, plain_episode), (stream, stream_episode) = runs[False], runs[True]
    assert stream == plain
    assert all(len(reply["token_ids"]) == len(reply["log_probs"]) > 0 for reply in stream)
    assert not plain_episode.error and not stream_episode.error
    (plain_row,), (stream_row,) = plain_episode.record.segments, stream_episode.record.segments
    for name in ("prompt_ids", "token_ids", "log_probs", "loss_mask"):
        assert getattr(stream_row, name) == getattr(plain_row, name), name
    # the row holds exactly the two sampled turns, each as the endpoint returned it
    sampled = [t for t, keep in zip(stream_row.token_ids, stream_row.loss_mask, strict=True) if keep]
    assert sampled == stream[0]["token_ids"] + stream[1]["token_ids"]


def test_a_streamed_tool_call_comes_in_openais_delta_form(served):
    """The last chunk of a choice with a call holds it as ``delta.tool_calls``: the client's own
    accumulator gives back the unstreamed reply's ``tool_calls`` and prose, for a call in the
    second of two choices whose chunks interleave (each by its ``index``) as the endpoint sends them."""
    tokenizer = served[0]
    texts = [
        "No call here.",
        'Let me look. <tool_call>{"name": "lookup", "arguments": {"q": "a b"}}</tool_call>',
    ]
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    replies = [assistant_reply(text, parse_hermes) for text in texts]
    assert [called for _, called in replies] == [False, True]
    builder = ResponseBuilder("chat", "policy", tokenizer, False)
    choices = [ChoiceState(j, [1, 2], IncrementalText(tokenizer)) for j in range(2)]
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for position in range(max(map(len, ids))):  # the token chunks: ids, no text (it is held back)
        for choice, tokens in zip(choices, ids, strict=True):
            if position < len(tokens):
                choice.add([tokens[position]], [-0.5], [0])
                chunk = builder.chunk(choice, "", [tokens[position]], [-0.5], [0], None, position == 0)
                state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    for choice, (reply, called) in zip(choices, replies, strict=True):
        rest = choice.finish("stop")
        reason = "tool_calls" if called else "stop"
        chunk = last_chunk(builder, choice, rest, ([], [], []), reply, True, reason, False)
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    plain, final = state.current_completion_snapshot.choices
    assert (plain.finish_reason, plain.message.content, plain.message.tool_calls) == ("stop", texts[0], None)
    assert final.finish_reason == "tool_calls" and final.message.content == "Let me look."
    (call,) = final.message.tool_calls
    (sent,) = replies[1][0]["tool_calls"]
    assert (call.id, call.function.name, call.function.arguments) == (
        sent["id"], "lookup", sent["function"]["arguments"]
    )  # fmt: skip
    assert json.loads(call.function.arguments) == {"q": "a b"}


def test_a_streamed_request_with_tools_holds_its_text_for_the_last_chunk(served):
    """With ``tools`` (and no call in the text) every token chunk's content is empty and the last
    one carries the whole reply: the same text as unstreamed."""
    replies = []
    for stream in (False, True):
        episode, client = open_episode(served, seed=5)
        messages = [{"role": "user", "content": "call something"}]
        if not stream:
            replies.append(unstreamed(client, messages, tools=TOOLS)["content"])
        else:
            chunks = list(
                client.chat.completions.create(
                    model="any", messages=messages, max_tokens=12, tools=TOOLS, stream=True
                )
            )
            contents = [chunk.choices[0].delta.content or "" for chunk in chunks]
            assert all(not content for content in contents[:-1]) and chunks[-1].choices[0].finish_reason
            replies.append(contents[-1])
        served[1].close(episode)
    assert replies[0] == replies[1] and replies[0]


def every_reply_calls(text: str) -> ParsedTurn:
    """A user's tool-call parser that reads every reply as one ``lookup`` call of what it says, so
    that a tiny model's turns come back as ``tool_calls``."""
    return ParsedTurn("", [ToolCall("lookup", {"said": text})])


def comparable(choice: dict) -> dict:
    """A choice as two replies to one request share it: its calls without their (random) ids, and
    no content as "" (a stream's accumulated content of a call-only reply is "", unstreamed None)."""
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls", [])
    ]
    return {k: v for k, v in choice.items() if k not in ("message", "content")} | {
        "calls": calls,
        "content": choice["content"] or "",
    }


@pytest.mark.parametrize("kind", ["text", "tools", "calls"])
def test_streamed_n_choices_are_the_unstreamed_ones_and_record_the_same_row(served, kind):
    """Two requests of ``n=3`` each, the program echoing choice 1 of the first, once streamed and
    once not under one seed: each choice's text, token ids, log-probs, finish reason, tool calls
    and the usage are equal (with ``tools`` the text is held for the last chunks; ``calls``: every
    choice's reply is a call), and so are the recorded rows, whose sampled tokens are the
    choices' in the recorder's order."""
    tokenizer, endpoint, _ = served
    extra = {"n": 3} | ({"tools": TOOLS} if kind != "text" else {})
    calling = ProgramEndpoint(endpoint.engine, tokenizer, every_reply_calls)
    with AppThread(calling.app) as server:
        where = (tokenizer, calling, server.url + "/v1") if kind == "calls" else served
        runs = {stream: two_requests(where, stream, extra) for stream in (False, True)}
    (plain, plain_row, plain_error), (stream, stream_row, stream_error) = runs[False], runs[True]
    assert not plain_error and not stream_error and stream_row.splits == plain_row.splits == 0
    assert [[comparable(c) for c in r] for r in stream] == [[comparable(c) for c in r] for r in plain]
    assert all(len(choice["token_ids"]) == len(choice["log_probs"]) > 0 for r in stream for choice in r)
    assert len({tuple(choice["token_ids"]) for choice in stream[0]}) > 1  # seed + j: three samples
    called = all(
        c["finish_reason"] == "tool_calls" and len(c["calls"]) == 1
        for r in stream
        for c in map(comparable, r)
    )
    assert called == (kind == "calls")
    for name in ("prompt_ids", "token_ids", "log_probs", "loss_mask", "segment_starts"):
        assert getattr(stream_row, name) == getattr(plain_row, name), name
    # the unechoed choices first (each a segment), then the row continued by choices 1 and 0
    (a0, a1, a2), (b0, b1, b2) = ([choice["token_ids"] for choice in r] for r in stream)
    sampled = [t for t, keep in zip(stream_row.token_ids, stream_row.loss_mask, strict=True) if keep]
    assert sampled == a0 + a2 + b1 + b2 + a1 + b0


def two_requests(served, stream: bool, extra: dict) -> tuple[list[list[dict]], Trajectory, str]:
    """An episode of two requests (each choice as the client reads it), echoing choice 1 of the
    first, then a tool's result or a user's reply; the episode's row and its error."""
    episode, client = open_episode(served, seed=17)
    messages, requests = [{"role": "user", "content": "pick one"}], []
    for turn in range(2):
        requests.append((streamed_choices if stream else unstreamed_choices)(client, messages, **extra))
        echoed = requests[-1][1]["message"]
        calls = echoed.get("tool_calls", [])
        messages += [echoed] + (
            [{"role": "tool", "tool_call_id": c["id"], "content": f"found {turn}"} for c in calls]
            or [{"role": "user", "content": f"then {turn}"}]
        )
    served[1].close(episode)
    return requests, episode.record.row(()), episode.error


def test_a_stream_abandoned_midway_fails_its_episode_unrecorded_and_frees_its_turn(served):
    """The client reads one chunk and hangs up: the generation is aborted, nothing is recorded,
    the episode is failed (499, as an unstreamed request whose client goes away), and its next
    request is answered (the turn it held is free)."""
    episode, client = open_episode(served, seed=9, end_of_sequence_stops=False)
    messages = [{"role": "user", "content": "a long one"}]
    stream = client.chat.completions.create(model="any", messages=messages, max_tokens=400, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while not episode.error and time.monotonic() < deadline:
        time.sleep(0.05)
    assert episode.error.startswith("HTTP 499") and episode.record.segments == []
    after = client.chat.completions.create(model="any", messages=messages, max_tokens=3, timeout=30)
    assert len(after.choices[0].model_extra["token_ids"]) == 3
    assert len(episode.record.segments) == 1 and not episode.in_engine
    served[1].close(episode)
