"""Starting the server: in the foreground (``tandem serve``) or on a background thread (tests, notebooks)."""

from __future__ import annotations

import dataclasses
import threading
import time

import uvicorn

from tandem.models.vision import ImagePrompter
from tandem.rollout.config import RolloutEngineConfig
from tandem.rollout.factory import build_rollout_engine
from tandem.serve.app import create_app
from tandem.serve.config import ServerConfig

STARTUP_TIMEOUT_S = 30.0


def build_engine(model_path: str, engine: str = "native", **engine_options):
    """A rollout engine over the HF model directory ``model_path`` and its tokenizer.

    ``engine`` names it (``native``, ``vllm`` or ``hf``); ``engine_options`` are fields of that
    engine's config class (:class:`NativeEngineConfig`, :class:`VLLMEngineConfig`,
    :class:`HFEngineConfig`), the others keep that class's defaults. Built by the rollout
    package's one factory.
    """
    config = RolloutEngineConfig(name=engine)
    options = type(config.selected)(**engine_options)
    return build_rollout_engine(dataclasses.replace(config, **{engine: options}), model_path)


def serve(
    engine, tokenizer, config: ServerConfig, log_level: str = "info", prompter: ImagePrompter | None = None
) -> None:
    """Serve until interrupted (Ctrl-C), then close the engine (``prompter``: a vision-language
    model's, for ``image_url`` parts)."""
    app = create_app(engine, tokenizer, config, prompter)
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        engine.close()


class AppThread:
    """An ASGI ``app`` served by uvicorn on a background thread of this process; a context manager.

    :meth:`start` returns once the socket is bound; ``url`` is then ``http://<host>:<port>``
    (``port=0`` binds any free port). :class:`ServerThread` is this over :func:`create_app`; the
    agent-program endpoint (:mod:`tandem.agents.program.endpoint`) is this over its own app.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, name: str = "tandem-server") -> None:
        self.app, self.host, self.port = app, host, port
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name=name, daemon=True)
        self.url = ""

    def start(self):
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerThread(AppThread):
    """The server on a background thread of this process; a context manager.

    ``with ServerThread(engine, tokenizer, ServerConfig(port=0)) as server:`` then point a
    client at ``server.url`` (``http://127.0.0.1:<port>/v1`` is ``server.url + "/v1"``).
    The engine stays open: closing it is the caller's business.
    """

    def __init__(
        self, engine, tokenizer, config: ServerConfig | None = None, prompter: ImagePrompter | None = None
    ) -> None:
        self.config = config or ServerConfig(port=0)
        super().__init__(
            create_app(engine, tokenizer, self.config, prompter), self.config.host, self.config.port
        )
