"""The OpenAI routes (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``): requests
checked against the server's limits, generated on the engine, answered whole or streamed."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from tandem.models.vision import ImagePrompter
from tandem.protocol.generation import RolloutRequest
from tandem.protocol.images import ImageInputs
from tandem.serve.config import ServerConfig
from tandem.serve.errors import APIError
from tandem.serve.generation import ChoiceRun, TokenEvent
from tandem.serve.prompts import chat_prompt, sampling_params, split_prompts, tokenize_prompts
from tandem.serve.responses import ChoiceState, ResponseBuilder
from tandem.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    invalid_text,
    unsupported_fields,
)
from tandem.serve.streams import StallGuardedStream
from tandem.serve.text import IncrementalText


def check_request(body: SamplingFields, config: ServerConfig) -> None:
    """The request's model, text and sampling fields against what this server serves and allows."""
    if body.model != config.model_name:
        raise APIError(
            404,
            f"model {body.model!r} is not served here; this server serves {config.model_name!r}",
            "model",
        )
    check_body(body, config)


def check_body(body: SamplingFields, config: ServerConfig) -> None:
    """The request's text and sampling fields against what this server implements and allows
    (:func:`check_request` without the model name; the agent-program endpoint takes any name)."""
    invalid = invalid_text(body)
    if invalid is not None:
        raise APIError(
            400,
            f"{invalid}: not valid Unicode (a lone surrogate such as \\ud800 has no UTF-8 form)",
            invalid,
        )
    problems = unsupported_fields(body)
    if problems:
        field, reason = problems[0]
        raise APIError(400, reason, field)
    if body.n > config.max_n:
        raise APIError(400, f"n={body.n} exceeds this server's limit of {config.max_n} (server.max_n)", "n")


def check_fan_out(body: SamplingFields, num_prompts: int, config: ServerConfig) -> None:
    """``n`` times the prompts against ``server.max_sequences_per_request``."""
    sequences = body.n * num_prompts
    if sequences > config.max_sequences_per_request:
        raise APIError(
            400,
            f"n={body.n} x {num_prompts} prompt(s) = {sequences} sequences exceeds this server's limit "
            f"of {config.max_sequences_per_request} per request (server.max_sequences_per_request)",
            "n",
        )


async def generate(
    engine,
    tokenizer,
    config: ServerConfig,
    body,
    kind: str,
    prompts: list[list[int]],
    default_max_tokens,
    request: Request,
    images: ImageInputs | None = None,
):
    """``body.n`` responses to each prompt (with the chat prompt's ``images``), answered whole or
    streamed (``body.stream``)."""
    builder = ResponseBuilder(kind, config.model_name, tokenizer, bool(body.logprobs))
    requests, choices = [], []
    for prompt in prompts:
        for sample in range(body.n):
            index = len(choices)
            params = sampling_params(
                body, len(prompt), engine.max_model_len, default_max_tokens, engine.vocab_size, sample
            )
            requests.append(RolloutRequest(f"{builder.id}-{index}", tuple(prompt), params, images))
            choices.append(ChoiceState(index, prompt, IncrementalText(tokenizer, params.stop)))
    run = ChoiceRun(engine, requests, config.request_timeout_s, request.is_disconnected, body.stream)
    events = (await run.start()).events()
    if not body.stream:
        done = [event async for event in events]
        if len(done) < len(choices):  # the client went away; nobody reads an answer
            return JSONResponse(APIError(499, "the client disconnected").body(), status_code=499)

        def assemble() -> dict:  # decoding every choice's text is CPU work: off the loop
            for event in done:
                choice = choices[event.choice]
                choice.absorb(event.completion)
                choice.finish(event.completion.finish_reason)
            return builder.response(choices, prompts, engine.version)

        return JSONResponse(await asyncio.to_thread(assemble))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StallGuardedStream(
        stream_events(builder, choices, prompts, events, include_usage),
        send_timeout_s=config.stream_send_timeout_s,
        media_type="text/event-stream",
    )


async def stream_events(builder, choices, prompts, events, include_usage: bool):
    """The server-sent events of a streamed response: a chunk per token, usage, ``[DONE]``."""
    started = [False] * len(choices)

    def chunk(choice, text, tokens, log_probs, versions, finish=None) -> str:
        body = builder.chunk(choice, text, tokens, log_probs, versions, finish, not started[choice.index])
        started[choice.index] = True
        return f"data: {json.dumps(body)}\n\n"

    try:
        async for event in events:
            choice = choices[event.choice]
            if isinstance(event, TokenEvent):
                text = choice.add([event.token_id], [event.log_prob], [event.version])
                yield chunk(choice, text, [event.token_id], [event.log_prob], [event.version])
            else:
                # the callback reported every token already (normally): ``added`` is empty
                text, *added = choice.absorb(event.completion)
                text += choice.finish(event.completion.finish_reason)
                yield chunk(choice, text, *added, event.completion.finish_reason)
        if include_usage:
            yield f"data: {json.dumps(builder.usage_chunk(choices, prompts))}\n\n"
        yield "data: [DONE]\n\n"
    except APIError as error:  # headers are sent: report in-band, as OpenAI-compatible servers do
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        await events.aclose()


def openai_router(
    engine,
    tokenizer,
    config: ServerConfig,
    authorize: Callable[[Request], None],
    prompter: ImagePrompter | None = None,
    image_slots: threading.Semaphore | None = None,
) -> APIRouter:
    """The ``/v1`` routes over ``engine`` (``tokenizer`` renders chat and decodes text; a
    vision-language model's ``prompter`` turns ``image_url`` parts into the prompt's images, a
    request holding one of ``image_slots`` meanwhile)."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])
    started_at = int(time.time())

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_request(body, config)
        given = split_prompts(body, config.max_prompts)
        check_fan_out(body, len(given), config)
        prompts = await asyncio.to_thread(tokenize_prompts, given, tokenizer)
        return await generate(
            engine, tokenizer, config, body, "completion", prompts, config.default_completion_tokens, request
        )

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_request(body, config)
        check_fan_out(body, 1, config)
        prompt, images = await asyncio.to_thread(chat_prompt, body, tokenizer, prompter, config, image_slots)
        return await generate(engine, tokenizer, config, body, "chat", [prompt], None, request, images)

    @v1.get("/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": started_at,
                    "owned_by": "tandem",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    return v1
