"""Incremental detokenization and stop-string matching.

Decoding token by token breaks multi-byte characters and merges, so text is
produced by decoding a small window and emitting only what is new and
complete (a trailing U+FFFD means a character may still be half-decoded):

    ids:   ... [prefix_offset ... read_offset) [read_offset ... end)
    delta = decode(ids[prefix_offset:]) minus what of it was sent already

A character is at most 4 bytes and a token at least one, so text that still ends in U+FFFD
after more than _MAX_PENDING new tokens is not a character arriving: those bytes are invalid
for good (a model can write lone continuation bytes forever). Then all but the last
_HOLD_CHARS replacement characters go out and the window moves on. Waiting for them instead
grew the window without bound: every step re-decoded the whole answer, and the final text
came back empty.

Stop strings are searched in the text tail that can contain a match ending in
the new delta, so a stop string split across tokens is still found.
"""

from __future__ import annotations

from typing import Any

_WINDOW = 6  # tokens of left context kept so merges and byte sequences decode right
_MAX_PENDING = 4  # new tokens a character still arriving can take: UTF-8's longest is 4 bytes
# Replacement characters the end of the text may hold for a character still arriving: one where
# a decoder replaces an incomplete sequence whole, one per byte (at most 3) with byte fallback.
_HOLD_CHARS = 3
_FFFD = "\ufffd"


def _trailing_fffd(text: str) -> int:
    return len(text) - len(text.rstrip(_FFFD))


class IncrementalDetokenizer:
    """Each step decodes at most _WINDOW + _MAX_PENDING + the new tokens, however long the
    answer or whatever bytes it holds."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.held = 0  # characters at the end of decode(ids[prefix_offset:read_offset]) not sent yet
        # The text so far, in the pieces it came in: `self.text += delta` copied the whole text
        # at every step (CPython grows a str in place only in a local variable), which made a
        # long answer quadratic. Steps read only its tail.
        self._parts: list[str] = []
        self.length = 0

    @property
    def text(self) -> str:
        """All the text so far: a join, for the end of a request, never for every step."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def tail(self, n: int) -> str:
        """The last n characters of the text (all of it if shorter): O(n)."""
        pieces, k = [], len(self._parts)
        while k and n > 0:
            k -= 1
            part = self._parts[k]
            pieces.append(part[-n:] if len(part) > n else part)
            n -= len(part)
        return "".join(reversed(pieces))

    def find_stop(self, delta_len: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
        """find_stop over the text, reading only the tail a match can lie in."""
        tail = self.tail(delta_len + stream_holdback(stops))
        hit = find_stop(tail, delta_len, stops)
        return None if hit is None else (self.length - len(tail) + hit[0], hit[1])

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def step(self, new_ids: list[int], final: bool = False) -> str:
        """Feed new token ids; return the newly completed text. At the `final` step a
        character still half-decoded (cut off by max_tokens) is left out: the text a client
        sees, streamed or whole, never ends in U+FFFD bytes it was not meant to see. Bytes
        that are invalid for good come out as U+FFFD, as the tokenizer decodes them."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        sent = len(prefix_text) - self.held
        overdue = len(self.ids) - self.read_offset > _MAX_PENDING
        if final or (overdue and full_text.endswith(_FFFD)):
            end = len(full_text) - min(_trailing_fffd(full_text), _HOLD_CHARS)
        elif full_text.endswith(_FFFD):
            return ""  # a character may still be arriving
        else:
            end = len(full_text)
        if end <= sent and not overdue:
            return ""  # nothing new yet
        delta = full_text[sent:end]
        self.held = max(len(full_text) - max(end, sent), 0)
        self.prefix_offset = max(len(self.ids) - _WINDOW, 0)
        self.read_offset = len(self.ids)
        if delta:
            self._parts.append(delta)
            self.length += len(delta)
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
        detok = self.detok
        delta = detok.step(token_ids, final=finished)
        hit = detok.find_stop(len(delta), self.stops) if self.stops and delta else None
        if hit is not None:
            end, self.stopped = hit[0], True
        else:
            end = detok.length if finished else max(detok.length - self.hold, self.sent)
        # What is not sent yet: the held-back characters and this delta, never the whole text.
        out = detok.tail(detok.length - self.sent)[: max(end - self.sent, 0)]
        self.sent = end
        return out

    @property
    def text(self) -> str:
        """Everything sent so far."""
        return self.detok.text[: self.sent]
