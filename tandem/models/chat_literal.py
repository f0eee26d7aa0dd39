"""A chat template rendered with the messages' text kept literal: a special-token string typed
inside a message (``<|im_end|>`` in a user's prompt) becomes the plain-text tokens of those
characters, never the control token, so it cannot open or close a role turn.

How: the template is rendered once with each message's text replaced by a placeholder, which
tells apart the template's own text from the messages'. The rendered prompt is then cut at
the template's special tokens (exactly where a tokenizer cuts it when it extracts added
tokens), and each piece between them is tokenized with ``split_special_tokens=True``, so the
special-token strings of the messages are split like any text. A prompt whose messages hold
no special-token string gets the ordinary ids, bit for bit (it takes the ordinary path).
"""

from __future__ import annotations

import re
from typing import Any

SPECIAL_TOKENS_IN_TEXT = ("text", "control")
_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")  # private-use marks around a message's number


def special_token_pattern(tokenizer: Any) -> re.Pattern | None:
    """A regex matching any of ``tokenizer``'s special added tokens (longest first), or ``None``
    when it has none."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    tokens = {str(token) for token in decoder.values() if getattr(token, "special", False)}
    tokens |= set(getattr(tokenizer, "all_special_tokens", ()))
    tokens.discard("")
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def message_texts(messages: list[dict]) -> list[str]:
    """The text of every message: its string content, or the ``text`` of its content-list parts, in order."""
    texts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return texts


def _with_placeholders(messages: list[dict]) -> list[dict]:
    """``messages`` with the i-th text (in :func:`message_texts` order) replaced by placeholder ``i``."""
    counter = iter(range(1 << 30))

    def mark() -> str:
        return f"\ue000{next(counter)}\ue001"

    marked = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            content = mark()
        elif isinstance(content, list):
            content = [
                {**p, "text": mark()} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                for p in content
            ]
        marked.append({**message, "content": content})
    return marked


def literal_template_ids(tokenizer: Any, messages: list[dict], **template_kwargs: Any) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template (``template_kwargs``:
    ``add_generation_prompt``, ``tools``, ...), the messages' text tokenized as plain text.

    ``ValueError`` when a message holds a special-token string and the template rewrites message
    text (the placeholder rendering then differs from the real one, so the messages' text cannot
    be located in the prompt).
    """
    texts = message_texts(messages)
    specials = special_token_pattern(tokenizer)
    if specials is None or not any(specials.search(text) for text in texts):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **template_kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    skeleton = tokenizer.apply_chat_template(_with_placeholders(messages), tokenize=False, **template_kwargs)
    pieces = _PLACEHOLDER.split(skeleton)  # template text, text number, template text, ...
    if _PLACEHOLDER.sub(lambda m: texts[int(m.group(1))], skeleton) != rendered:
        raise ValueError(
            "a message holds a special-token string and this chat template rewrites message text, "
            "so the string cannot be kept as plain text; remove it, or set special_tokens_in_text=control"
        )
    ids: list[int] = []
    chunk: list[str] = []  # text since the template's last special token

    def flush() -> None:
        if chunk:
            encoded = tokenizer("".join(chunk), add_special_tokens=False, split_special_tokens=True)
            ids.extend(encoded["input_ids"])
            chunk.clear()

    for i, piece in enumerate(pieces):
        if i % 2:  # a message's text: always plain
            chunk.append(texts[int(piece)])
            continue
        start = 0
        for match in specials.finditer(piece):  # the template's own special tokens stay control tokens
            chunk.append(piece[start : match.start()])
            flush()
            ids.append(tokenizer.convert_tokens_to_ids(match.group()))
            start = match.end()
        chunk.append(piece[start:])
    flush()
    return ids
