"""Settings of the OpenAI-compatible server."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.validation import check_positive, check_range


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server listens and what it accepts.

    Attributes:
        host: interface to bind; ``127.0.0.1`` (loopback only) unless you mean to expose it.
        port: TCP port (0: any free port, reported once bound).
        model_name: the id under which ``/v1/models`` lists the model and requests must name it.
        api_key: when set, ``/v1/*`` and ``/admin/*`` need ``Authorization: Bearer <api_key>``.
        request_timeout_s: a generation request still unfinished after this many seconds is
            aborted and answered with 408.
        max_request_bytes: larger request bodies are refused with 413.
        max_n: most choices (``n``) per request.
        max_prompts: most prompts in one ``/v1/completions`` batch.
        default_completion_tokens: ``max_tokens`` of a completion request that sets none.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "tandem"
    api_key: str | None = None
    request_timeout_s: float = 600.0
    max_request_bytes: int = 4 * 1024 * 1024
    max_n: int = 64
    max_prompts: int = 256
    default_completion_tokens: int = 16

    def __post_init__(self) -> None:
        check_range("server", "port", self.port, 0, 65535)
        for name in (
            "request_timeout_s",
            "max_request_bytes",
            "max_n",
            "max_prompts",
            "default_completion_tokens",
        ):
            check_positive("server", name, getattr(self, name))
        if not self.model_name:
            raise ValueError("server.model_name must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("server.api_key must not be blank (leave it unset to disable auth)")
