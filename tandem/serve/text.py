"""Turning response tokens into text as they arrive: stop strings cut, partial characters held back."""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class IncrementalText:
    """The text of a growing token sequence, emitted in deltas that never need retracting.

    Text is decoded without special tokens, a short window at a time: each push decodes the
    tokens from ``prefix_offset`` (a few tokens of context, so tokenizers that merge across
    token boundaries decode correctly) and keeps what extends the context's own text — not
    the whole response again, which would make a long stream quadratic. When a stop string appears the text ends just
    before it (OpenAI semantics) and later tokens add nothing. Until the response ends, the
    last ``len(longest stop) - 1`` characters are held back (they could be the start of a stop
    string), as is a trailing incomplete character.

    Args:
        tokenizer: an HF tokenizer.
        stop: stop strings (may be empty).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # window start: context tokens already part of ``decoded``
        self.read_offset = 0  # tokens up to here are part of ``decoded``
        self.decoded = ""  # the text of ``token_ids[:read_offset]``
        self.text = ""  # everything decoded so far, cut at a stop string
        self.emitted = 0  # characters of ``text`` already returned
        self.stopped = False  # a stop string was found

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; returns the newly safe text."""
        if self.stopped or not token_ids:
            return ""
        self.token_ids.extend(token_ids)
        self._refresh(final=False)
        if self.stopped:
            return self._emit(len(self.text))
        hold = max((len(s) for s in self.stop), default=1) - 1
        return self._emit(len(self.text) - hold)

    def finish(self) -> str:
        """The response ended: returns whatever was still held back (an incomplete character too)."""
        if not self.stopped:
            self._refresh(final=True)
        return self._emit(len(self.text))

    def _refresh(self, final: bool) -> None:
        """Decode the window; keep its new text unless it ends mid-character (and more may come)."""
        context = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.token_ids[self.prefix_offset :])
        if len(window) > len(context) and (final or not window.endswith(REPLACEMENT_CHAR)):
            self.decoded += window[len(context) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text = self.decoded
        cut = self._stop_position()
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else ""

    def _stop_position(self) -> int | None:
        # A stop string can only newly appear in the region not yet emitted (plus its own length).
        start = max(self.emitted - max((len(s) for s in self.stop), default=0), 0)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _emit(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta


def final_text(tokenizer, token_ids: list[int], stop: tuple[str, ...] = ()) -> str:
    """The whole response text (special tokens skipped, cut before the first stop string)."""
    text = IncrementalText(tokenizer, stop)
    return text.push(list(token_ids)) + text.finish()


def token_strings(tokenizer, token_ids: list[int]) -> list[str]:
    """Each token decoded on its own (the ``token`` field of logprobs entries)."""
    return [tokenizer.decode([t]) for t in token_ids]
