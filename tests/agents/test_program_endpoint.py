"""The agent-program endpoint's request surface over real HTTP with the real ``openai`` client:
streamed replies (``stream=true``) and ``n``.

The references: the same request unstreamed under the same seed (its text, token ids, log-probs
and usage, and what the recorder keeps of it) for a streamed one, as the ``openai`` client's
own stream accumulator (``ChatCompletionStreamState``) puts the chunks together; and the
unstreamed reply's ``tool_calls`` for the streamed tool-call deltas."""

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
from tandem.agents.tool_calls import parse_hermes  # noqa: E402
from tandem.agents.trajectory import TurnEncoder  # noqa: E402
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


def unstreamed(client, messages, **extra) -> dict:
    reply = client.chat.completions.create(
        model="any", messages=messages, max_tokens=12, logprobs=True, **extra
    )
    choice = reply.choices[0]
    return {
        "content": choice.message.content,
        "token_ids": choice.model_extra["token_ids"],
        "log_probs": [entry.logprob for entry in choice.logprobs.content],
        "finish_reason": choice.finish_reason,
        "usage": reply.usage.model_dump(),
    }


def streamed(client, messages, **extra) -> dict:
    """The stream read chunk by chunk, and put together by the client's own accumulator."""
    state, token_ids, log_probs, usage = ChatCompletionStreamState(), [], [], None
    for chunk in client.chat.completions.create(
        model="any", messages=messages, max_tokens=12, logprobs=True, stream=True,
        stream_options={"include_usage": True}, **extra,
    ):  # fmt: skip
        state.handle_chunk(chunk)
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            token_ids += choice.model_extra["token_ids"]
            log_probs += [entry.logprob for entry in (choice.logprobs.content if choice.logprobs else [])]
    (choice,) = state.current_completion_snapshot.choices
    return {
        "content": choice.message.content,
        "token_ids": token_ids,
        "log_probs": log_probs,
        "finish_reason": choice.finish_reason,
        "usage": usage,
    }


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
    """The last chunk of a turn with a call holds it as ``delta.tool_calls``: the client's own
    accumulator gives back the unstreamed reply's ``tool_calls`` and prose."""
    tokenizer = served[0]
    text = 'Let me look. <tool_call>{"name": "lookup", "arguments": {"q": "a b"}}</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    reply, called = assistant_reply(text, parse_hermes)
    assert called
    builder = ResponseBuilder("chat", "policy", tokenizer, False)
    choice = ChoiceState(0, [1, 2], IncrementalText(tokenizer))
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for position, token in enumerate(ids):  # the token chunks: ids, no text (it is held back)
        choice.add([token], [-0.5], [0])
        state.handle_chunk(
            ChatCompletionChunk.model_validate(
                builder.chunk(choice, "", [token], [-0.5], [0], None, position == 0)
            )
        )
    rest = choice.finish("stop")
    chunk = last_chunk(builder, choice, rest, ([], [], []), reply, True, "tool_calls", False)
    state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    (final,) = state.current_completion_snapshot.choices
    assert final.finish_reason == "tool_calls" and final.message.content == "Let me look."
    (call,) = final.message.tool_calls
    (sent,) = reply["tool_calls"]
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


def test_n_above_one_streamed_is_refused_naming_n(served):
    episode, client = open_episode(served, seed=3)
    with pytest.raises(openai.BadRequestError, match="takes n=1, not n=2") as refused:
        client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "x"}], n=2, stream=True
        )
    assert refused.value.body["param"] == "n"
    assert "n=1" in episode.error and episode.record.segments == []
    served[1].close(episode)


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
