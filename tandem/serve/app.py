"""The OpenAI-compatible HTTP server over any :class:`~tandem.rollout.RolloutEngine`.

Routes: ``/v1/completions``, ``/v1/chat/completions`` (streaming or not), ``/v1/models``,
``/health``, ``/metrics``, and ``/admin/*`` (pause, resume, update weights from a directory,
weight version, sleep, wake, reset the prefix cache). With ``api_key`` set, ``/v1/*`` and
``/admin/*`` need the bearer token; ``/health`` and ``/metrics`` stay open for probes.

The event loop only routes: CPU-bound work (chat templates, tokenizing, assembling a whole
response) and engine calls that take the engine's lock (submit, abort, metrics) run on worker
threads, so one heavy request never delays ``/health`` or the others.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.rollout.types import RolloutRequest
from tandem.rollout.weights import read_hf_weights
from tandem.serve.config import ServerConfig
from tandem.serve.errors import APIError
from tandem.serve.generation import ChoiceRun, TokenEvent
from tandem.serve.limits import BodySizeLimit
from tandem.serve.metrics import HTTPCounters, RouteCounter, render_metrics
from tandem.serve.prompts import chat_prompt, sampling_params, split_prompts, tokenize_prompts
from tandem.serve.responses import ChoiceState, ResponseBuilder
from tandem.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    PauseRequest,
    SamplingFields,
    UpdateWeightsRequest,
    unsupported_fields,
)
from tandem.serve.streams import StallGuardedStream
from tandem.serve.text import IncrementalText


def create_app(engine, tokenizer, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (its ``tokenizer`` renders chat and decodes text)."""
    config = config or ServerConfig()
    context = engine.max_model_len
    vocab_size = engine.vocab_size
    http = HTTPCounters()
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None)
    weights_lock = asyncio.Lock()

    # ------------------------------------------------------------------ errors, limits, auth
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = first.get("msg", "invalid request")
        return APIError(400, f"{where}: {message}" if where else message, where).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return APIError(error.status_code, str(error.detail)).response()

    app.add_middleware(BodySizeLimit, limit=config.max_request_bytes)
    # outermost, so refused bodies (413) count too; labels are the schema's paths, never the client's
    served_paths: list[str] = []  # filled once every route is registered, below
    app.add_middleware(RouteCounter, counters=http, route_templates=served_paths)

    api_key = None if config.api_key is None else config.api_key.encode()

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # bytes, not str: compare_digest refuses non-ASCII str (a client's header would be a 500);
        # headers arrive latin-1 decoded, so this gets the client's raw bytes back
        sent = token.strip().encode("latin-1", "replace")
        if scheme.lower() != "bearer" or not secrets.compare_digest(sent, api_key):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])
    admin = APIRouter(prefix="/admin", dependencies=[Depends(authorize)])

    # ------------------------------------------------------------------ generation
    def check_request(body: SamplingFields) -> None:
        if body.model != config.model_name:
            raise APIError(
                404,
                f"model {body.model!r} is not served here; this server serves {config.model_name!r}",
                "model",
            )
        problems = unsupported_fields(body)
        if problems:
            field, reason = problems[0]
            raise APIError(400, reason, field)
        if body.n > config.max_n:
            raise APIError(
                400, f"n={body.n} exceeds this server's limit of {config.max_n} (server.max_n)", "n"
            )

    def check_fan_out(body: SamplingFields, num_prompts: int) -> None:
        sequences = body.n * num_prompts
        if sequences > config.max_sequences_per_request:
            raise APIError(
                400,
                f"n={body.n} x {num_prompts} prompt(s) = {sequences} sequences exceeds this server's limit "
                f"of {config.max_sequences_per_request} per request (server.max_sequences_per_request)",
                "n",
            )

    async def generate(body, kind: str, prompts: list[list[int]], default_max_tokens, request: Request):
        builder = ResponseBuilder(kind, config.model_name, tokenizer, bool(body.logprobs))
        requests, choices = [], []
        for prompt in prompts:
            for sample in range(body.n):
                index = len(choices)
                params = sampling_params(body, len(prompt), context, default_max_tokens, vocab_size, sample)
                requests.append(RolloutRequest(f"{builder.id}-{index}", tuple(prompt), params))
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

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_request(body)
        given = split_prompts(body, config.max_prompts)
        check_fan_out(body, len(given))
        prompts = await asyncio.to_thread(tokenize_prompts, given, tokenizer)
        return await generate(body, "completion", prompts, config.default_completion_tokens, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_request(body)
        check_fan_out(body, 1)
        prompt = await asyncio.to_thread(chat_prompt, body, tokenizer)
        return await generate(body, "chat", [prompt], None, request)

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
                    "max_model_len": context,
                }
            ],
        }

    # ------------------------------------------------------------------ admin
    @admin.post("/pause")
    async def pause(body: PauseRequest):
        await asyncio.to_thread(engine.pause, body.mode)
        return {"paused": True, "mode": body.mode}

    @admin.post("/resume")
    async def resume():
        await asyncio.to_thread(engine.resume)
        return {"paused": False}

    @admin.get("/weight_version")
    async def weight_version():
        return {"version": engine.version}

    @admin.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest):
        """Read the directory's tensors, then pause (keep), load, resume: requests continue."""
        async with weights_lock:
            version = engine.version + 1 if body.version is None else body.version
            if version <= engine.version:
                raise APIError(
                    409, f"version must increase: got {version}, current {engine.version}", "version"
                )
            try:
                tensors = await asyncio.to_thread(lambda: list(read_hf_weights(body.path)))
            except FileNotFoundError as error:
                raise APIError(400, str(error), "path") from error
            was_paused = (await asyncio.to_thread(engine.metrics)).paused
            if not was_paused:
                await asyncio.to_thread(engine.pause, "keep")
            try:
                loaded = await asyncio.to_thread(engine.update_weights, tensors, version)
            except (KeyError, ValueError) as error:
                raise APIError(400, f"these weights do not fit the served model: {error}", "path") from error
            finally:
                if not was_paused:
                    await asyncio.to_thread(engine.resume)
        return {"version": version, "tensors": loaded}

    @admin.post("/sleep")
    async def sleep():
        try:
            await asyncio.to_thread(engine.sleep)
        except RuntimeError as error:
            raise APIError(409, str(error)) from error
        return {"asleep": True}

    @admin.post("/wake")
    async def wake():
        await asyncio.to_thread(engine.wake)
        return {"asleep": False}

    @admin.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await asyncio.to_thread(engine.reset_prefix_cache)
        return {"reset": True}

    # ------------------------------------------------------------------ probes
    @app.get("/health")
    async def health():
        return {"status": "ok", "version": engine.version}

    @app.get("/metrics")
    async def metrics():
        snapshot = await asyncio.to_thread(engine.metrics)  # takes the engine's lock: a step may hold it
        return PlainTextResponse(
            render_metrics(snapshot, http, config.model_name),
            media_type="text/plain; version=0.0.4",
        )

    started_at = int(time.time())
    app.include_router(v1)
    app.include_router(admin)
    served_paths.extend(app.openapi()["paths"])
    return app
