"""A server-sent-event response that gives up on a client that stopped reading."""

from __future__ import annotations

import asyncio
import logging

from starlette.responses import StreamingResponse

logger = logging.getLogger(__name__)


class StallGuardedStream(StreamingResponse):
    """A :class:`StreamingResponse` that stops when one chunk cannot be sent for ``send_timeout_s``.

    A client that keeps the connection open but stops reading fills the socket buffers, after
    which every send waits. Past the timeout the stream's iterator is closed (which aborts its
    engine requests) and the connection is dropped, instead of generating to the end for nobody.
    A client that disconnects is handled by Starlette (the stream is cancelled).
    """

    def __init__(self, content, *, send_timeout_s: float, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.send_timeout_s = send_timeout_s

    async def stream_response(self, send) -> None:
        async def patient_send(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout_s)
            except asyncio.TimeoutError:
                raise ClientStalled from None

        try:
            await super().stream_response(patient_send)
        except ClientStalled:
            logger.warning(
                "a stream's client took no data for %g s; its requests were aborted", self.send_timeout_s
            )
            await self.body_iterator.aclose()


class ClientStalled(Exception):
    """A chunk waited longer than the send timeout."""
