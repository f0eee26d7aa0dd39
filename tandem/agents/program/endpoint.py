"""The OpenAI-compatible endpoint agent programs call: ``POST /v1/chat/completions`` and
``GET /v1/models`` over the run's rollout engine, one API key per episode.

The key (``Authorization: Bearer <key>``, what ``openai.AsyncOpenAI(api_key=...)`` sends) names
the episode, so concurrent episodes never mix; an unknown key is answered 401, the key of an
episode that has ended 409 (the last ``ENDED_KEPT`` ended keys are kept; an older one is then
unknown). Requests are parsed, checked and rendered by ``tandem serve``'s own
code (:mod:`tandem.serve.schemas`, :func:`~tandem.serve.prompts.chat_prompt`,
:class:`~tandem.serve.generation.ChoiceRun`, :class:`~tandem.serve.responses.ResponseBuilder`),
then recorded token by token (:mod:`~tandem.agents.program.recorder`). Any model name is accepted.

What differs from ``tandem serve``: sampling is the run's (``rollout.temperature``, ``top_p``,
``top_k``, the episode's seed), whatever the request says, so the recorded log-probs are the
ones the trainer computes; ``max_tokens`` / ``max_completion_tokens`` is cut to what the row and
the episode have left (shared by the ``n`` choices, below); ``continue_final_message`` and
``add_generation_prompt=false`` are refused (400); with ``tools`` the model's calls come back as
``tool_calls``. ``stream=true`` streams the reply as ``tandem serve`` does
(:mod:`~tandem.agents.program.streaming`; with a tool-call parser the text comes whole in the
last chunk; with ``n`` > 1 each chunk names its choice's ``index``) and gets and records exactly
what the same request unstreamed does: the same seeds, so the same tokens. A request answered
4xx or 5xx (or a stream that reports an error, or that its client abandons before the end)
marks its episode failed (reward 0, counted in ``agent/program/errors``), whatever the program
does next. An episode that ends while a request of it is still being answered (its program did
not await the answer, or a stream's end) aborts that request and records nothing of it;
:meth:`ProgramEndpoint.close` says how many there were (the runner's fault).

``n`` > 1 (streamed or not): choice ``j`` samples with the request's seed plus ``j``. An episode's
row continues only with a reply the program echoes back in its next request: that choice
continues the row, and every other choice becomes a segment of its own in the same row (its
context and its sampled tokens, :meth:`~tandem.agents.program.recorder.EpisodeRecord.commit_choices`),
so every sampled token trains, all under the episode's reward; when no request echoes one (the
program's last request, or a rewritten history), the first choice continues the row. Each
choice may sample ``room // n`` tokens of what the row has left less the other choices' contexts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from tandem.agents.program.config import ProgramLimits
from tandem.agents.program.recorder import EpisodeRecord, TurnPlan
from tandem.agents.program.replies import assistant_reply
from tandem.agents.program.streaming import DONE, drain, event, last_chunk
from tandem.agents.tool_calls import ToolCallParser
from tandem.protocol.generation import Completion, RolloutRequest, SamplingParams
from tandem.serve.app import add_error_handlers
from tandem.serve.config import ServerConfig
from tandem.serve.errors import APIError
from tandem.serve.generation import ChoiceRun, DoneEvent
from tandem.serve.limits import BodySizeLimit
from tandem.serve.openai_routes import check_body
from tandem.serve.prompts import chat_prompt
from tandem.serve.responses import ChoiceState, ResponseBuilder
from tandem.serve.schemas import ChatCompletionRequest
from tandem.serve.streams import StallGuardedStream
from tandem.serve.text import IncrementalText

REQUEST_SEED_STRIDE = 1_000_003  # request r of an episode samples with seed + r * stride
MODEL_NAME = "policy"  # what /v1/models lists; requests may name any model
ENDED_KEPT = 65536  # ended episodes whose keys still get 409 (a long run's keys must not pile up)


class ProgramChatRequest(ChatCompletionRequest):
    """A chat request as agent frameworks send it: ``tool_choice`` too (``"none"`` leaves the
    model's calls as text)."""

    tool_choice: str | dict | None = None


@dataclass
class Turn:
    """One request between its start and its recording: its plan, its engine requests (one per
    choice), and the response it builds (its choices; the tool-call parser when the request
    offered tools)."""

    plan: TurnPlan
    request_ids: list[str]
    run: ChoiceRun
    builder: ResponseBuilder
    choices: list[ChoiceState]
    parser: ToolCallParser | None


@dataclass(eq=False)
class Episode:
    """One episode's endpoint state: its key, its recording, its limits and sampling, the first
    error it was answered (empty: none), whether it has ended, its requests in the engine, the
    requests being answered (from their arrival until their answer, or a stream's last event, is
    decided) and how many were when it ended (``unfinished``; -1 while it runs)."""

    key: str
    name: str
    record: EpisodeRecord
    limits: ProgramLimits
    sampling: SamplingParams
    seed: int
    error: str = ""
    closed: bool = False
    in_engine: set[str] = field(default_factory=set)
    answering: int = 0
    unfinished: int = -1
    # closed, error, in_engine, answering and the recording's changes
    mutex: threading.Lock = field(default_factory=threading.Lock)
    turn_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request of an episode at a time

    def fault(self, message: str) -> None:
        with self.mutex:
            if not self.error:
                self.error = message

    def enter(self) -> Callable[[], None]:
        """Count a request being answered; the function returned ends it (once, however often
        it is called)."""
        with self.mutex:
            self.answering += 1
        left: list[bool] = []

        def leave() -> None:
            with self.mutex:
                if not left:
                    left.append(True)
                    self.answering -= 1

        return leave


class ProgramEndpoint:
    """The endpoint's episodes and its app (see the module docstring); serve ``app`` with
    :class:`~tandem.serve.launch.AppThread`."""

    def __init__(
        self, engine, tokenizer, parser: ToolCallParser | None, config: ServerConfig | None = None
    ) -> None:
        self.engine, self.tokenizer, self.parser = engine, tokenizer, parser
        self.config = config or ServerConfig(port=0, model_name=MODEL_NAME)
        self.episodes: dict[str, Episode] = {}
        # the last ``ended_kept`` ended episodes' keys (409, not 401), oldest first
        self.ended: dict[str, None] = {}
        self.ended_kept = ENDED_KEPT
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

    def close(self, episode: Episode) -> int:
        """End the episode: later requests get 409, its requests in the engine are aborted, and its
        recording no longer changes. The requests it was still answering then (its
        ``unfinished``, kept from the first close): the program ended without awaiting them."""
        with episode.mutex:
            if not episode.closed:
                episode.closed, episode.unfinished = True, episode.answering
            running = list(episode.in_engine)
        with self.lock:
            self.episodes.pop(episode.key, None)
            self.ended[episode.key] = None
            if len(self.ended) > self.ended_kept:  # an older key is then answered as unknown (401)
                del self.ended[next(iter(self.ended))]
        for request_id in running:
            self.engine.abort(request_id)
        return episode.unfinished

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
    async def complete(self, episode: Episode, request: Request, leave: Callable[[], None]) -> Response:
        """Answer one chat request of ``episode`` and record it (see the module docstring); one
        request of an episode at a time (a streamed one holds its turn until its stream ends, and
        calls ``leave`` as its last event is decided)."""
        await episode.turn_lock.acquire()
        handed_over = False
        try:
            body, turn = await self._start(episode, request)
            if body.stream:
                queue: asyncio.Queue = asyncio.Queue()
                task = asyncio.ensure_future(self._stream_turn(episode, body, turn, queue, leave))
                task.add_done_callback(lambda _: (leave(), episode.turn_lock.release()))
                handed_over = True
                return StallGuardedStream(
                    drain(queue, task), send_timeout_s=self.config.stream_send_timeout_s,
                    media_type="text/event-stream",
                )  # fmt: skip
            try:
                done = [event async for event in turn.run.events()]
            finally:
                self._left_engine(episode, turn)
            if len(done) < len(turn.choices):
                raise APIError(499, "the client disconnected")
            completions = [event.completion for event in sorted(done, key=lambda event: event.choice)]
            for choice, completion in zip(turn.choices, completions, strict=True):
                choice.absorb(completion)
                choice.finish(completion.finish_reason)
            replies = self._commit(episode, turn, completions)
            prompts = [list(turn.plan.context_ids)] * len(turn.choices)
            answer = turn.builder.response(turn.choices, prompts, self.engine.version)
            for entry, (reply, called) in zip(answer["choices"], replies, strict=True):
                entry["message"] = reply
                if called:
                    entry["finish_reason"] = "tool_calls"
            return JSONResponse(answer)
        finally:
            if not handed_over:
                episode.turn_lock.release()

    async def _start(self, episode: Episode, request: Request) -> tuple[ProgramChatRequest, Turn]:
        """Check and parse the request, plan its context and submit it to the engine."""
        if episode.closed:
            raise APIError(409, "this episode has ended: its API key takes no more requests")
        record, limits = episode.record, episode.limits
        if record.requests >= limits.max_requests:
            raise APIError(
                400, f"this episode has made its {limits.max_requests} requests (agent.program_max_requests)"
            )
        record.requests += 1
        body = self._parse(await request.body())
        messages = [m.as_template_message() for m in body.messages]
        render_key = json.dumps([body.tools, body.chat_template_kwargs], sort_keys=True, default=str)

        def plan_open() -> TurnPlan:
            with episode.mutex:  # an ended episode's recording no longer changes
                if episode.closed:
                    raise APIError(409, "this episode has ended: its API key takes no more requests")
                return record.plan(
                    messages, render_key, lambda: chat_prompt(body, self.tokenizer, None, self.config)[0]
                )

        plan = await asyncio.to_thread(plan_open)
        params = self._sampling(episode, body, len(plan.context_ids), plan)
        name = f"{episode.name}-request{record.requests - 1}"
        request_ids = [name] + [f"{name}-choice{j}" for j in range(1, body.n)]
        requests = [
            RolloutRequest(request_id, plan.context_ids, dataclasses.replace(params, seed=params.seed + j))
            for j, request_id in enumerate(request_ids)
        ]
        run = ChoiceRun(
            self.engine, requests, self.config.request_timeout_s, request.is_disconnected, body.stream
        )
        turn = Turn(
            plan, request_ids, run, ResponseBuilder("chat", body.model, self.tokenizer, bool(body.logprobs)),
            [ChoiceState(j, list(plan.context_ids), IncrementalText(self.tokenizer, params.stop)) for j in range(body.n)],
            self.parser if body.tools and body.tool_choice != "none" else None,
        )  # fmt: skip
        with episode.mutex:  # once ended, no request of it enters the engine (none would abort it)
            if episode.closed:
                raise APIError(409, "this episode has ended: its API key takes no more requests")
            episode.in_engine.update(request_ids)
        try:
            await run.start()
        except BaseException:
            self._left_engine(episode, turn)
            raise
        with episode.mutex:
            ended = episode.closed
        if ended:  # it ended while these were being submitted: close() could not abort them yet
            await asyncio.to_thread(run.abort_pending)
            self._left_engine(episode, turn)
            raise APIError(409, "this episode ended while its request was generating")
        return body, turn

    async def _stream_turn(
        self, episode: Episode, body: ProgramChatRequest, turn: Turn, queue: asyncio.Queue,
        leave: Callable[[], None],
    ) -> None:  # fmt: skip
        """Put the streamed events of ``turn`` on ``queue`` (:mod:`~tandem.agents.program.streaming`),
        record the turn before its last chunks, then ``None``. The choices' token chunks come as
        they are sampled, each with its choice's ``index``; each choice's last chunk waits until
        every choice has finished (the turn is recorded whole, as unstreamed). An error once the
        stream has started is reported in-band (as ``tandem serve`` does) and fails the episode,
        as a stream its client abandons does (the turn is not recorded then)."""
        held = turn.parser is not None  # with a parser the text waits for the last chunk
        started = [False] * len(turn.choices)  # whether a choice has had its first chunk
        try:
            completions = await self._stream_tokens(turn, queue, held, started)
            self._left_engine(episode, turn)
            ends = []  # per choice: the text not sent yet and the tokens added at the end
            for choice, completion in zip(turn.choices, completions, strict=True):
                text, *added = choice.absorb(completion)
                ends.append((text + choice.finish(completion.finish_reason), added))
            replies = self._commit(episode, turn, completions)
            for choice, completion, (text, added), (reply, called) in zip(
                turn.choices, completions, ends, replies, strict=True
            ):
                reason = "tool_calls" if called else completion.finish_reason
                chunk = last_chunk(
                    turn.builder, choice, text, added, reply, held, reason, not started[choice.index]
                )
                queue.put_nowait(event(chunk))
            if body.stream_options and body.stream_options.include_usage:
                prompts = [list(turn.plan.context_ids)] * len(turn.choices)
                queue.put_nowait(event(turn.builder.usage_chunk(turn.choices, prompts)))
            queue.put_nowait(DONE)
        except APIError as error:
            episode.fault(f"HTTP {error.status}: {error.message}")
            queue.put_nowait(event(error.body()))
        except asyncio.CancelledError:
            episode.fault("HTTP 499: the client stopped reading its stream before the end")
            raise
        finally:
            self._left_engine(episode, turn)
            leave()  # no await since the last event was queued: its client has not seen it yet
            queue.put_nowait(None)

    @staticmethod
    async def _stream_tokens(
        turn: Turn, queue: asyncio.Queue, held: bool, started: list[bool]
    ) -> list[Completion]:
        """Put a chunk on ``queue`` for each token ``turn``'s choices sample (empty ``content``
        when ``held``) until every choice has finished; their completions, in choice order. 499
        when the client went away first."""
        done: dict[int, Completion] = {}
        async for item in turn.run.events():
            if isinstance(item, DoneEvent):
                done[item.choice] = item.completion
                continue
            choice, tokens = turn.choices[item.choice], ([item.token_id], [item.log_prob], [item.version])
            text = choice.add(*tokens)
            chunk = turn.builder.chunk(choice, "" if held else text, *tokens, None, not started[item.choice])
            queue.put_nowait(event(chunk))
            started[item.choice] = True
        if len(done) < len(turn.choices):
            raise APIError(499, "the client disconnected")
        return [done[j] for j in range(len(turn.choices))]

    def _commit(self, episode: Episode, turn: Turn, completions: list[Completion]) -> list[tuple[dict, bool]]:
        """Record the finished turn (its choices' ``completions``); for each choice, the assistant
        message the program gets and whether it holds tool calls. 409 when the episode ended
        meanwhile (the recording no longer changes)."""
        replies = [assistant_reply(choice.text.text, turn.parser) for choice in turn.choices]
        with episode.mutex:
            if episode.closed:
                raise APIError(409, "this episode ended while its request was generating")
            episode.record.commit_choices(turn.plan, completions, [reply for reply, _ in replies])
        return replies

    @staticmethod
    def _left_engine(episode: Episode, turn: Turn) -> None:
        with episode.mutex:
            episode.in_engine.difference_update(turn.request_ids)

    def _parse(self, raw: bytes) -> ProgramChatRequest:
        """The body as a chat request, checked like ``tandem serve`` checks it, and what this
        endpoint refuses besides."""
        try:
            body = ProgramChatRequest.model_validate_json(raw)
        except ValidationError as error:  # serve's handler words it: "<field>: <reason>"
            raise RequestValidationError(error.errors()) from error
        check_body(body, self.config)
        for refused, why in (
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
        self, episode: Episode, body: ProgramChatRequest, context: int, plan: TurnPlan
    ) -> SamplingParams:
        """The run's sampling for this request: the tokens each choice may take (the request's
        ask, cut to the row's, the episode's and the model's room, the first two shared by the
        ``n`` choices), its stop strings and its (first choice's) seed."""
        record, limits = episode.record, episode.limits
        rooms = {
            "rollout.max_response_length (the row's response columns)": plan.choice_room(body.n),
            "agent.program_max_tokens (the episode's sampled tokens)": (limits.max_tokens - record.sampled)
            // body.n,
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
            leave, response = episode.enter(), None
            try:
                response = await self.complete(episode, request, leave)
                return response
            except APIError as error:
                episode.fault(f"HTTP {error.status}: {error.message}")
                raise
            except RequestValidationError as error:
                first = error.errors()[0] if error.errors() else {}
                episode.fault(f"HTTP 400: a malformed request ({first.get('msg', 'invalid')})")
                raise
            finally:  # a fault is recorded first; a stream leaves with its last event
                if not isinstance(response, StallGuardedStream):
                    leave()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "tandem"}]}

        return app
