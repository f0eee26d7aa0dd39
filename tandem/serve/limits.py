"""An ASGI wrapper refusing request bodies over a byte limit with 413, whether declared or streamed."""

from __future__ import annotations

from starlette.exceptions import HTTPException

from tandem.serve.errors import APIError


class BodySizeLimit:
    """Refuse bodies over ``limit`` bytes: at once when ``Content-Length`` says so, else while reading."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        message = f"the request body exceeds {self.limit} bytes (server.max_request_bytes)"
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await APIError(413, message).response()(scope, receive, send)
            return
        received = 0

        async def counted_receive():
            nonlocal received
            event = await receive()
            if event["type"] == "http.request":
                received += len(event.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413, message)
            return event

        await self.app(scope, counted_receive, send)
