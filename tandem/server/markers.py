"""Finding markers (`<tool_call>`, `</think>`, ...) in text that arrives in pieces.

A streaming parser may send text only up to where a marker could still begin: the earliest
full marker, or a tail that is the start of one. Deciding only on what the text so far already
settles makes the result the same however the text was cut into pieces.
"""

from __future__ import annotations


def find_marker(text: str, markers: tuple[str, ...], final: bool) -> tuple[int, str | None]:
    """(index, marker) of the earliest marker in `text`; (index, None) where only a tail that may
    begin a marker is left (never when `final`); (len(text), None) when neither."""
    best, found = len(text), None
    for m in markers:
        i = text.find(m)
        if i != -1 and (i < best or (i == best and found is not None and len(m) > len(found))):
            best, found = i, m
    if not final:
        tail = partial_tail(text, markers)
        if tail < best:
            return tail, None
    return best, found


def partial_tail(text: str, markers: tuple[str, ...]) -> int:
    """Where the longest tail of `text` that is a proper start of a marker begins (len(text): none)."""
    longest = max((len(m) for m in markers), default=1)
    for i in range(max(len(text) - longest + 1, 0), len(text)):
        if any(m.startswith(text[i:]) and len(m) > len(text) - i for m in markers):
            return i
    return len(text)
