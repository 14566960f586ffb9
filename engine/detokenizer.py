"""Incremental detokenization and stop-string matching.

Decoding token by token breaks multi-byte characters and merges, so text is
produced by decoding a small window and emitting only what is new and
complete (a trailing U+FFFD means a character is still half-decoded):

    ids:   ... [prefix_offset ... read_offset) [read_offset ... end)
    delta = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

Stop strings are searched in the text tail that can contain a match ending in
the new delta, so a stop string split across tokens is still found.
"""

from __future__ import annotations

from typing import Any

_WINDOW = 6  # tokens of left context kept so merges and byte sequences decode right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def step(self, new_ids: list[int], final: bool = False) -> str:
        """Feed new token ids; return the newly completed text. At the `final` step a
        character still half-decoded (cut off by max_tokens) is left out: the text a client
        sees, streamed or whole, never ends in U+FFFD bytes it was not meant to see."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if final:
            full_text = full_text.rstrip("\ufffd")
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = max(len(self.ids) - _WINDOW, 0)
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, delta_len: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(index, stop) of the earliest stop string ending inside the last delta_len chars."""
    best: tuple[int, str] | None = None
    for s in stops:
        start = max(len(text) - delta_len - len(s) + 1, 0)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def stream_holdback(stops: tuple[str, ...]) -> int:
    """Characters to hold back while streaming: they may begin a stop string."""
    return max((len(s) - 1 for s in stops), default=0)


class TextStream:
    """A request's text as its tokens arrive, cut at the first stop string.

    `feed` returns the text safe to send now: while streaming, the last
    stream_holdback(stops) characters may begin a stop string and are held back
    until they cannot; at the end (or at a stop) everything before the stop goes out."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stops = stops
        self.hold = stream_holdback(stops)
        self.sent = 0
        self.stopped = False  # a stop string was found: nothing more will be sent

    def feed(self, token_ids: list[int], finished: bool) -> str:
        if self.stopped:
            return ""
        delta = self.detok.step(token_ids, final=finished)
        text = self.detok.text
        hit = find_stop(text, len(delta), self.stops) if self.stops and delta else None
        if hit is not None:
            text, self.stopped = text[: hit[0]], True
        end = len(text) if finished or self.stopped else max(len(text) - self.hold, self.sent)
        out, self.sent = text[self.sent : end], end
        return out

    @property
    def text(self) -> str:
        """Everything sent so far."""
        return self.detok.text[: self.sent]
