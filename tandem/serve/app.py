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
import secrets
import threading
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.models.vision import ImagePrompter
from tandem.serve.admin_routes import admin_router
from tandem.serve.config import ServerConfig
from tandem.serve.errors import APIError
from tandem.serve.limits import BodySizeLimit
from tandem.serve.metrics import HTTPCounters, RouteCounter, render_metrics
from tandem.serve.openai_routes import openai_router


def create_app(
    engine, tokenizer, config: ServerConfig | None = None, prompter: ImagePrompter | None = None
) -> FastAPI:
    """The FastAPI app serving ``engine`` (its ``tokenizer`` renders chat and decodes text; a
    vision-language model's ``prompter`` takes the images of ``image_url`` parts)."""
    config = config or ServerConfig()
    http = HTTPCounters()
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None)

    add_error_handlers(app)
    app.add_middleware(BodySizeLimit, limit=config.max_request_bytes)
    # outermost, so refused bodies (413) count too; labels are the schema's paths, never the client's
    served_paths: list[str] = []  # filled once every route is registered, below
    app.add_middleware(RouteCounter, counters=http, route_templates=served_paths)
    authorize = _bearer_check(config.api_key)

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

    # the requests decoding images at once (server.max_image_requests); on app.state for probes and tests
    app.state.image_slots = threading.BoundedSemaphore(config.max_image_requests)
    app.include_router(openai_router(engine, tokenizer, config, authorize, prompter, app.state.image_slots))
    app.include_router(admin_router(engine, authorize))
    served_paths.extend(app.openapi()["paths"])
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours (:class:`APIError`), a body that fails validation
    (400, naming the field), Starlette's HTTP errors, and a bug (500; its traceback goes to the log)."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        # our own validators' messages come prefixed with "Value error, ": the client needs only the reason
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        return APIError(400, f"{where}: {message}" if where else message, where).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        """A bug, not the client's fault: still OpenAI's error shape (the traceback goes to the log)."""
        return APIError(500, f"internal server error ({type(error).__name__})").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return APIError(error.status_code, str(error.detail)).response()


def _bearer_check(api_key: str | None) -> Callable[[Request], None]:
    """The routes' dependency that checks ``Authorization: Bearer <api_key>`` (``APIError`` 401
    otherwise); with no key it lets every request through."""
    key = None if api_key is None else api_key.encode()

    def authorize(request: Request) -> None:
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # bytes, not str: compare_digest refuses non-ASCII str (a client's header would be a 500);
        # headers arrive latin-1 decoded, so this gets the client's raw bytes back
        sent = token.strip().encode("latin-1", "replace")
        if scheme.lower() != "bearer" or not secrets.compare_digest(sent, key):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")

    return authorize
