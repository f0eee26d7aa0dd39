"""Settings of the OpenAI-compatible server."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from tandem.config.validation import check_choice, check_positive, check_range
from tandem.models.chat_literal import SPECIAL_TOKENS_IN_TEXT


def is_loopback(host: str) -> bool:
    """True when ``host`` only accepts connections from this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname: it may resolve to any interface
        return False


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server listens and what it accepts.

    Attributes:
        host: interface to bind; ``127.0.0.1`` (loopback only) unless you mean to expose it.
            A non-loopback host needs ``api_key`` unless ``allow_unauthenticated`` is set.
        port: TCP port (0: any free port, reported once bound).
        model_name: the id under which ``/v1/models`` lists the model and requests must name it.
        api_key: when set, ``/v1/*`` and ``/admin/*`` need ``Authorization: Bearer <api_key>``.
        allow_unauthenticated: allow a non-loopback ``host`` without ``api_key`` (anyone who
            can reach the port may then generate and swap weights).
        request_timeout_s: a generation request still unfinished after this many seconds is
            aborted and answered with 408.
        stream_send_timeout_s: a stream whose client has not taken a chunk for this many
            seconds (it stopped reading) is cut and its requests aborted.
        max_request_bytes: larger request bodies are refused with 413.
        max_n: most choices (``n``) per request.
        max_prompts: most prompts in one ``/v1/completions`` batch.
        max_sequences_per_request: most engine sequences one request may start
            (``n`` × number of prompts).
        default_completion_tokens: ``max_tokens`` of a completion request that sets none.
        max_images_per_request: most ``image_url`` parts in one chat request (vision-language
            models only).
        max_image_pixels: an image larger than this (decoded width x height) is refused with
            400 before it is decoded.
        max_request_image_pixels: most decoded pixels (width x height, summed over its images)
            one chat request may bring; an image that would pass it is refused with 400 before
            it is decoded.
        max_image_requests: most requests decoding and processing images at once; one more
            is answered 429 at once (the client retries later).
        special_tokens_in_text: ``text`` (a special-token string typed in a message, such as
            ``<|im_end|>``, is tokenized as plain text, so a client cannot forge role turns) or
            ``control`` (it becomes the control token: transformers' and vLLM's default).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "tandem"
    api_key: str | None = None
    allow_unauthenticated: bool = False
    request_timeout_s: float = 600.0
    stream_send_timeout_s: float = 30.0
    max_request_bytes: int = 4 * 1024 * 1024
    max_n: int = 64
    max_prompts: int = 256
    max_sequences_per_request: int = 256
    default_completion_tokens: int = 16
    max_images_per_request: int = 8
    max_image_pixels: int = 4096 * 4096
    max_request_image_pixels: int = 2 * 4096 * 4096
    max_image_requests: int = 2
    special_tokens_in_text: str = "text"

    def __post_init__(self) -> None:
        check_range("server", "port", self.port, 0, 65535)
        for name in (
            "request_timeout_s",
            "stream_send_timeout_s",
            "max_request_bytes",
            "max_n",
            "max_prompts",
            "max_sequences_per_request",
            "default_completion_tokens",
            "max_images_per_request",
            "max_image_pixels",
            "max_request_image_pixels",
            "max_image_requests",
        ):
            check_positive("server", name, getattr(self, name))
        check_choice("server", "special_tokens_in_text", self.special_tokens_in_text, SPECIAL_TOKENS_IN_TEXT)
        if not self.model_name:
            raise ValueError("server.model_name must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("server.api_key must not be blank (leave it unset to disable auth)")
        if self.api_key is None and not self.allow_unauthenticated and not is_loopback(self.host):
            raise ValueError(
                f"server.host={self.host!r} is reachable from other machines but server.api_key is "
                "unset: set --api-key (or TANDEM_API_KEY), or pass --allow-unauthenticated to serve "
                "without auth on purpose"
            )
