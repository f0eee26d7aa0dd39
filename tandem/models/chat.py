"""Chat messages: their validation and their rendering to token ids with a tokenizer's chat template."""

from __future__ import annotations

from typing import Any

from tandem.models.chat_literal import literal_template_ids

ROLES = ("system", "user", "assistant", "tool")


def check_message(message: Any, where: str) -> None:
    """A chat message is a dict with a known string ``role`` and non-empty string ``content``;
    ``where`` names it in the error (file, row and turn)."""
    if (
        not isinstance(message, dict)
        or not isinstance(message.get("role"), str)
        or not isinstance(message.get("content"), str)
    ):
        raise ValueError(f"{where} needs string 'role' and 'content' fields, got {message!r}")
    if message["role"] not in ROLES:
        raise ValueError(f"{where} has role {message['role']!r}; roles are {', '.join(ROLES)}")
    if not message["content"].strip():
        raise ValueError(f"{where} ({message['role']}) has empty content")


def template_ids(
    tokenizer: Any,
    messages: list[dict],
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
    special_tokens_in_text: str = "control",
) -> list[int]:
    """Token ids of ``messages`` (and the ``tools``' schemas) rendered with the tokenizer's chat template.

    ``special_tokens_in_text``: ``control`` tokenizes a special-token string typed inside a
    message (``<|im_end|>``) as that control token, as transformers and vLLM do; ``text``
    tokenizes it as plain text (:mod:`tandem.models.chat_literal`), so message text can never
    open or close a role turn.
    """
    if special_tokens_in_text == "text":
        return literal_template_ids(
            tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt
        )
    if special_tokens_in_text != "control":
        raise ValueError(f"special_tokens_in_text={special_tokens_in_text!r}; choose text or control")
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


IMAGE_PLACEHOLDER = "<image>"  # where verl's multimodal rows put each image in a message's text


def with_image_parts(messages: list[dict], placeholder: str = IMAGE_PLACEHOLDER) -> tuple[list[dict], int]:
    """``messages`` with each string content that holds ``placeholder`` turned into a content list
    of ``{"type": "text", "text"}`` and ``{"type": "image"}`` parts in order (the form a
    vision-language chat template renders), and the number of placeholders found. Messages
    without one are returned as they are."""
    converted, count = [], 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str) or placeholder not in content:
            converted.append(message)
            continue
        parts: list[dict] = []
        for i, text in enumerate(content.split(placeholder)):
            if i:
                parts.append({"type": "image"})
                count += 1
            if text:
                parts.append({"type": "text", "text": text})
        converted.append({**message, "content": parts})
    return converted, count
