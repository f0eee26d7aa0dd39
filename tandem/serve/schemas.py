"""Request bodies of the OpenAI-compatible API (pydantic), with tandem's extension fields.

Fields OpenAI defines but tandem does not implement are accepted only at their neutral value;
anything else is a 400 that names the field (see :func:`unsupported_fields`).

Bodies are validated strictly: ``true`` is not a number (``max_tokens: true`` would otherwise be
1), a number is not a string or a bool, and an integer field takes no ``2.0``. Text that is not
valid Unicode (a lone surrogate such as ``"\\ud800"``, which JSON allows but UTF-8 cannot encode)
is refused by :func:`invalid_text` before any tokenizer sees it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_SEED = 2**63 - 1  # seeds travel as int64 through the engines


STRICT = ConfigDict(strict=True)  # JSON true is not 1, "yes" is not a bool (see the module docstring)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions.

    Extensions: ``top_k`` (0 or -1: off), ``stop_token_ids``, ``ignore_eos``,
    ``logprobs_mode`` (``processed``: under the distribution sampled from; ``raw``).
    """

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    ignore_eos: bool = False
    logprobs_mode: Literal["processed", "raw"] = "processed"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @field_validator("stop")
    @classmethod
    def _no_empty_stop_string(cls, stop: str | list[str] | None) -> str | list[str] | None:
        """An empty stop string matches everywhere: the text would end before its first token."""
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("an empty stop string would end every response at once; leave it out")
        return stop


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a batch of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = STRICT

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    """An OpenAI ``image_url`` content part; only ``data:`` URLs are accepted (the server never
    fetches a URL a client names)."""

    model_config = STRICT

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    # tool_calls, name, tool_call_id go to the template as given
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def image_parts(self) -> list[tuple[int, ImagePart]]:
        """``(part index, part)`` of each image in the content, in order."""
        parts = self.content if isinstance(self.content, list) else []
        return [(i, part) for i, part in enumerate(parts) if isinstance(part, ImagePart)]

    def as_template_message(self) -> dict[str, Any]:
        """The message as the chat template takes it: text parts joined into one string, or, when
        the content holds images, a list of ``{"type": "text", "text"}`` and ``{"type": "image"}``
        parts in order (the form vision-language templates render placeholders from)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if self.image_parts():
                message["content"] = [
                    {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
                    for part in self.content
                ]
            else:
                message["content"] = "".join(part.text for part in self.content)
        message.setdefault("content", "")
        return message


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template.

    ``tools`` and ``chat_template_kwargs`` are passed to the template; tool calls come back
    as plain text in ``message.content`` (an agent loop parses them). A client's own template
    (``chat_template``, top level or in ``chat_template_kwargs``) is refused: rendering
    arbitrary Jinja costs the server unbounded CPU.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # accepted only to refuse it by name
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    response_format: dict[str, Any] | None = None


class PauseRequest(BaseModel):
    model_config = STRICT

    mode: Literal["keep", "abort", "wait"] = "keep"


class UpdateWeightsRequest(BaseModel):
    """``path``: an HF model directory (``*.safetensors`` or ``pytorch_model*.bin``) on the server's disk."""

    model_config = STRICT

    path: str
    version: int | None = None


CLIENT_TEMPLATE = "a client-supplied chat template is not accepted; the model's own template is used"


NO_TEXT = {int, float, bool, type(None)}  # the JSON values that cannot hold a string


def invalid_text(body: BaseModel) -> str | None:
    """The path (``prompt.1``, ``messages.0.content``) of the first string in ``body`` that is not
    valid Unicode, or None. A lone surrogate cannot be encoded as UTF-8: a tokenizer given one
    raises, and a chat template renders it into a prompt no tokenizer can read."""
    pending: list[tuple[str, object]] = [("", body.model_dump())]
    while pending:  # a stack, not recursion: a deeply nested body must not overflow it
        path, value = pending.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(value, dict):
            pending.extend((f"{path}.{key}" if path else str(key), inner) for key, inner in value.items())
        # token ids hold no text: a 4 MiB body of them is skipped in C, not walked id by id on the loop
        elif isinstance(value, list) and not set(map(type, value)) <= NO_TEXT:
            pending.extend((f"{path}.{index}", inner) for index, inner in enumerate(value))
    return None


def unsupported_fields(body: SamplingFields) -> list[tuple[str, str]]:
    """``(field, reason)`` for each field set to a value tandem does not implement."""
    problems = []
    if body.presence_penalty or body.frequency_penalty:
        problems.append(("presence_penalty", "presence/frequency penalties are not supported"))
    if body.logit_bias:
        problems.append(("logit_bias", "logit_bias is not supported"))
    if isinstance(body, CompletionRequest):
        if body.echo:
            problems.append(("echo", "echo is not supported (no prompt log-probabilities)"))
        if body.suffix:
            problems.append(("suffix", "suffix is not supported"))
        if body.best_of not in (None, 1, body.n):
            problems.append(("best_of", "best_of other than n is not supported"))
        if body.logprobs is not None and body.logprobs > 1:
            problems.append(
                ("logprobs", "only the sampled token's log-probability is returned (logprobs <= 1)")
            )
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs:
            problems.append(
                ("top_logprobs", "only the sampled token's log-probability is returned (top_logprobs = 0)")
            )
        if body.chat_template is not None:
            problems.append(("chat_template", f"chat_template: {CLIENT_TEMPLATE}"))
        if body.chat_template_kwargs and "chat_template" in body.chat_template_kwargs:
            field = "chat_template_kwargs.chat_template"
            problems.append((field, f"{field}: {CLIENT_TEMPLATE}"))
        if body.response_format and body.response_format.get("type") not in (None, "text"):
            problems.append(("response_format", "only text responses are supported"))
    return problems
