"""Turning response tokens into text as they arrive: stop strings cut, partial characters held back."""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class IncrementalText:
    """The text of a growing token sequence, emitted in deltas that never need retracting.

    Text is decoded without special tokens. When a stop string appears the text ends just
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
        self.text = ""  # everything decoded so far, cut at a stop string
        self.emitted = 0  # characters of ``text`` already returned
        self.stopped = False  # a stop string was found

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; returns the newly safe text."""
        if self.stopped or not token_ids:
            return ""
        self.token_ids.extend(token_ids)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = self._stop_position()
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
            return self._emit(len(self.text))
        hold = max((len(s) for s in self.stop), default=1) - 1
        end = len(self.text) - hold
        if self.text.endswith(REPLACEMENT_CHAR):
            end = min(end, len(self.text) - 1)
        return self._emit(end)

    def finish(self) -> str:
        """The response ended: returns whatever was still held back."""
        return self._emit(len(self.text))

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
