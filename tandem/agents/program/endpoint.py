"""The OpenAI-compatible endpoint agent programs call: ``POST /v1/chat/completions`` and
``GET /v1/models`` over the run's rollout engine, one API key per episode.

The key (``Authorization: Bearer <key>``, what ``openai.AsyncOpenAI(api_key=...)`` sends) names
the episode, so concurrent episodes never mix; an unknown key is answered 401, the key of an
episode that has ended 409. Requests are parsed, checked and rendered by ``tandem serve``'s own
code (:mod:`tandem.serve.schemas`, :func:`~tandem.serve.prompts.chat_prompt`,
:class:`~tandem.serve.generation.ChoiceRun`, :class:`~tandem.serve.responses.ResponseBuilder`),
then recorded token by token (:mod:`~tandem.agents.program.recorder`). Any model name is accepted.

What differs from ``tandem serve``: sampling is the run's (``rollout.temperature``, ``top_p``,
``top_k``, the episode's seed), whatever the request says, so the recorded log-probs are the
ones the trainer computes; ``max_tokens`` / ``max_completion_tokens`` is cut to what the row and
the episode have left; ``n`` must be 1; ``stream``, ``continue_final_message`` and
``add_generation_prompt=false`` are refused (400); with ``tools`` the model's calls come back
as ``tool_calls``. A request answered 4xx or 5xx marks its episode failed (reward 0, counted in
``agent/program/errors``), whatever the program does next.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import threading
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from tandem.agents.program.config import ProgramLimits
from tandem.agents.program.recorder import EpisodeRecord
from tandem.agents.program.replies import assistant_reply
from tandem.agents.tool_calls import ToolCallParser
from tandem.protocol.generation import RolloutRequest, SamplingParams
from tandem.serve.app import add_error_handlers
from tandem.serve.config import ServerConfig
from tandem.serve.errors import APIError
from tandem.serve.generation import ChoiceRun
from tandem.serve.limits import BodySizeLimit
from tandem.serve.openai_routes import check_body
from tandem.serve.prompts import chat_prompt
from tandem.serve.responses import ChoiceState, ResponseBuilder
from tandem.serve.schemas import ChatCompletionRequest
from tandem.serve.text import IncrementalText

REQUEST_SEED_STRIDE = 1_000_003  # request r of an episode samples with seed + r * stride
MODEL_NAME = "policy"  # what /v1/models lists; requests may name any model


class ProgramChatRequest(ChatCompletionRequest):
    """A chat request as agent frameworks send it: ``tool_choice`` too (``"none"`` leaves the
    model's calls as text)."""

    tool_choice: str | dict | None = None


@dataclass(eq=False)
class Episode:
    """One episode's endpoint state: its key, its recording, its limits and sampling, the first
    error it was answered (empty: none), whether it has ended, and its requests in the engine."""

    key: str
    name: str
    record: EpisodeRecord
    limits: ProgramLimits
    sampling: SamplingParams
    seed: int
    error: str = ""
    closed: bool = False
    in_engine: set[str] = field(default_factory=set)
    mutex: threading.Lock = field(default_factory=threading.Lock)  # closed, error, in_engine, commit
    turn_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request of an episode at a time

    def fault(self, message: str) -> None:
        with self.mutex:
            if not self.error:
                self.error = message


class ProgramEndpoint:
    """The endpoint's episodes and its app (see the module docstring); serve ``app`` with
    :class:`~tandem.serve.launch.AppThread`."""

    def __init__(
        self, engine, tokenizer, parser: ToolCallParser | None, config: ServerConfig | None = None
    ) -> None:
        self.engine, self.tokenizer, self.parser = engine, tokenizer, parser
        self.config = config or ServerConfig(port=0, model_name=MODEL_NAME)
        self.episodes: dict[str, Episode] = {}
        self.ended: set[str] = set()  # keys of ended episodes: 409, not 401
        self.lock = threading.Lock()
        self.app = self._build_app()

    # ------------------------------------------------------------------ episodes
    def open(
        self, name: str, record: EpisodeRecord, limits: ProgramLimits, sampling: SamplingParams, seed: int
    ) -> Episode:
        """A new episode with a fresh key."""
        episode = Episode(secrets.token_urlsafe(24), name, record, limits, sampling, seed)
        with self.lock:
            self.episodes[episode.key] = episode
        return episode

    def close(self, episode: Episode) -> None:
        """End the episode: later requests get 409, its requests in the engine are aborted, and its
        recording no longer changes."""
        with episode.mutex:
            episode.closed = True
            running = list(episode.in_engine)
        with self.lock:
            self.episodes.pop(episode.key, None)
            self.ended.add(episode.key)
        for request_id in running:
            self.engine.abort(request_id)

    def episode_of(self, request: Request) -> Episode:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip()
        with self.lock:
            episode = self.episodes.get(key) if scheme.lower() == "bearer" else None
            ended = key in self.ended
        if ended:
            raise APIError(409, "this episode has ended: its API key takes no more requests")
        if episode is None:
            raise APIError(401, "unknown API key: each episode's program gets its own (OPENAI_API_KEY)")
        return episode

    # ------------------------------------------------------------------ one request
    async def complete(self, episode: Episode, request: Request) -> JSONResponse:
        """Answer one chat request of ``episode`` and record it (see the module docstring)."""
        async with episode.turn_lock:
            if episode.closed:
                raise APIError(409, "this episode has ended: its API key takes no more requests")
            record, limits = episode.record, episode.limits
            if record.requests >= limits.max_requests:
                raise APIError(
                    400, f"this episode has made its {limits.max_requests} requests "
                    "(agent.program_max_requests)",
                )  # fmt: skip
            record.requests += 1
            body = self._parse(await request.body())
            messages = [m.as_template_message() for m in body.messages]
            render_key = json.dumps([body.tools, body.chat_template_kwargs], sort_keys=True, default=str)
            plan = await asyncio.to_thread(
                record.plan, messages, render_key,
                lambda: chat_prompt(body, self.tokenizer, None, self.config)[0],
            )  # fmt: skip
            params = self._sampling(episode, body, len(plan.context_ids), plan.room)
            request_id = f"{episode.name}-request{record.requests - 1}"
            with episode.mutex:
                episode.in_engine.add(request_id)
            try:
                run = ChoiceRun(
                    self.engine, [RolloutRequest(request_id, plan.context_ids, params)],
                    self.config.request_timeout_s, request.is_disconnected, stream=False,
                )  # fmt: skip
                done = [event async for event in (await run.start()).events()]
            finally:
                with episode.mutex:
                    episode.in_engine.discard(request_id)
            if not done:
                raise APIError(499, "the client disconnected")
            completion = done[0].completion
            builder = ResponseBuilder("chat", body.model, self.tokenizer, bool(body.logprobs))
            choice = ChoiceState(0, list(plan.context_ids), IncrementalText(self.tokenizer, params.stop))
            choice.absorb(completion)
            choice.finish(completion.finish_reason)
            answer = builder.response([choice], [list(plan.context_ids)], self.engine.version)
            parser = self.parser if body.tools and body.tool_choice != "none" else None
            reply, called = assistant_reply(choice.text.text, parser)
            answer["choices"][0]["message"] = reply
            if called:
                answer["choices"][0]["finish_reason"] = "tool_calls"
            with episode.mutex:
                if episode.closed:
                    raise APIError(409, "this episode ended while its request was generating")
                record.commit(plan, completion, reply)
            return JSONResponse(answer)

    def _parse(self, raw: bytes) -> ProgramChatRequest:
        """The body as a chat request, checked like ``tandem serve`` checks it, and what this
        endpoint refuses besides."""
        try:
            body = ProgramChatRequest.model_validate_json(raw)
        except ValidationError as error:  # serve's handler words it: "<field>: <reason>"
            raise RequestValidationError(error.errors()) from error
        check_body(body, self.config)
        for refused, why in (
            (body.n != 1, "n: an agent program's request takes n=1 (each episode is one trajectory)"),
            (body.stream, "stream: streaming is not supported for agent programs yet; send stream=false"),
            (body.continue_final_message, "continue_final_message is not supported for agent programs"),
            (
                not body.add_generation_prompt,
                "add_generation_prompt=false is not supported for agent programs",
            ),
        ):
            if refused:
                raise APIError(400, why, why.split(" ")[0].rstrip(":"))
        return body

    def _sampling(
        self, episode: Episode, body: ProgramChatRequest, context: int, room: int
    ) -> SamplingParams:
        """The run's sampling for this request: the tokens it may take (the request's ask, cut to
        the row's, the episode's and the model's room), its stop strings and its seed."""
        record, limits = episode.record, episode.limits
        rooms = {
            "rollout.max_response_length (the row's response columns)": room,
            "agent.program_max_tokens (the episode's sampled tokens)": limits.max_tokens - record.sampled,
            "the model's context": self.engine.max_model_len - context,
        }
        limit, left = min(rooms.items(), key=lambda item: item[1])
        if left < 1:
            raise APIError(400, f"this episode has no tokens left under {limit}", "max_tokens")
        asked = body.max_completion_tokens or body.max_tokens or left
        stop_ids = tuple(body.stop_token_ids or ())
        if any(not 0 <= t < self.engine.vocab_size for t in stop_ids):
            raise APIError(400, f"stop_token_ids must lie in [0, {self.engine.vocab_size})", "stop_token_ids")
        return dataclasses.replace(
            episode.sampling,
            max_tokens=min(asked, left),
            stop=body.stop_strings(),
            stop_token_ids=tuple(dict.fromkeys(episode.sampling.stop_token_ids + stop_ids)),
            seed=episode.seed + (record.requests - 1) * REQUEST_SEED_STRIDE,
        )

    # ------------------------------------------------------------------ the app
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="tandem agent programs", docs_url=None, redoc_url=None)
        add_error_handlers(app)
        app.add_middleware(BodySizeLimit, limit=self.config.max_request_bytes)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            episode = self.episode_of(request)
            try:
                return await self.complete(episode, request)
            except APIError as error:
                episode.fault(f"HTTP {error.status}: {error.message}")
                raise
            except RequestValidationError as error:
                first = error.errors()[0] if error.errors() else {}
                episode.fault(f"HTTP 400: a malformed request ({first.get('msg', 'invalid')})")
                raise

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "tandem"}]}

        return app
