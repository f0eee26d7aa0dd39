"""Running one API request's engine requests (n choices × prompts) as a stream of events.

Every choice is submitted at once; the engine's per-token callback and each future's
completion are forwarded, in order (both come from the engine thread), onto an asyncio
queue. The caller consumes :class:`TokenEvent` and :class:`DoneEvent` items; a deadline or
a client that went away aborts whatever is unfinished.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from tandem.protocol.generation import Completion, RolloutRequest
from tandem.serve.errors import APIError

DISCONNECT_POLL_S = 0.25  # how often a running request checks that its client is still there


@dataclass
class TokenEvent:
    choice: int
    token_id: int
    log_prob: float
    version: int


@dataclass
class DoneEvent:
    choice: int
    completion: Completion


class ChoiceRun:
    """One API request's engine requests (choice ``i`` is ``requests[i]``), run to completion.

    :meth:`start` submits them all and raises :class:`APIError` (400) at once when the engine
    rejects one (a bad prompt), so even a streaming response can still answer 4xx.
    :meth:`events` then yields their events as they happen (:class:`TokenEvent` only when
    ``stream``), raising 408 when the deadline passes and 500 when generation itself failed.
    Every ``DISCONNECT_POLL_S`` it asks ``disconnected()`` whether the client went away, even
    while tokens keep coming. Unfinished requests are aborted on any exit of :meth:`events`
    (error, timeout, disconnect, or the consumer closing the iterator). Engine calls (submit,
    abort) run on a worker thread: the engine's lock is held for a whole step, and the event
    loop must keep answering other requests meanwhile.
    """

    def __init__(
        self,
        engine,
        requests: list[RolloutRequest],
        timeout_s: float,
        disconnected: Callable[[], Awaitable[bool]] | None = None,
        stream: bool = True,
    ) -> None:
        self.engine = engine
        self.requests = requests
        self.timeout_s = timeout_s
        self.disconnected = disconnected
        self.stream = stream
        self.pending = set(range(len(requests)))
        self.queue: asyncio.Queue = asyncio.Queue()
        self.deadline = time.monotonic() + timeout_s

    async def start(self) -> ChoiceRun:
        loop = asyncio.get_running_loop()

        def listener(choice: int):
            return lambda token, log_prob, version: loop.call_soon_threadsafe(
                self.queue.put_nowait, TokenEvent(choice, token, log_prob, version)
            )

        def on_done(choice: int):
            return lambda future: loop.call_soon_threadsafe(self.queue.put_nowait, (choice, future))

        def submit_all():
            futures = []
            for choice, request in enumerate(self.requests):
                future = self.engine.submit(request, on_token=listener(choice) if self.stream else None)
                future.add_done_callback(on_done(choice))
                futures.append(future)
            rejected = next((f for f in futures if f.done() and f.exception() is not None), None)
            if rejected is not None:
                self.abort_pending()
            return rejected

        submitting = loop.run_in_executor(None, submit_all)
        try:
            rejected = await asyncio.shield(submitting)
        except asyncio.CancelledError:  # nobody will consume these: abort them once submitted
            submitting.add_done_callback(lambda _: loop.run_in_executor(None, self.abort_pending))
            raise
        if rejected is not None:
            _completion(rejected)  # raises the 400
        return self

    async def events(self) -> AsyncIterator[TokenEvent | DoneEvent]:
        next_poll = time.monotonic() + DISCONNECT_POLL_S
        try:
            while self.pending:
                now = time.monotonic()
                remaining = self.deadline - now
                if remaining <= 0:
                    raise APIError(
                        408, f"the request did not finish within {self.timeout_s:g} s and was aborted"
                    )
                if self.disconnected is not None and now >= next_poll:
                    next_poll = now + DISCONNECT_POLL_S
                    if await self.disconnected():
                        return
                try:
                    item = await asyncio.wait_for(self.queue.get(), timeout=min(remaining, DISCONNECT_POLL_S))
                except asyncio.TimeoutError:
                    continue
                if isinstance(item, TokenEvent):
                    yield item
                    continue
                choice, future = item
                self.pending.discard(choice)
                yield DoneEvent(choice, _completion(future))
        finally:
            if self.pending:
                # shielded: a cancelled consumer still gets its requests aborted
                await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, self.abort_pending))

    def abort_pending(self) -> None:
        for choice in list(self.pending):
            self.engine.abort(self.requests[choice].request_id)


def _completion(future) -> Completion:
    try:
        completion = future.result()
    except ValueError as error:  # the engine's verdict on a bad request
        raise APIError(400, str(error)) from error
    if completion.finish_reason == "error":
        raise APIError(500, f"generation failed: {completion.error}")
    return completion
