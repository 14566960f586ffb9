"""The seam between the scanner and a model's tool-call format.

A format names the markers that open a call region (anywhere in the answer, or only at its
start) and reads one region: how much text it takes and the calls in it, or that it is not a
call after all (then that text is content). It decides only once the text settles it: a
region that more text could still turn valid or invalid is `None` until `final`, and a
decision, once made, stands whatever text follows. That is what makes a streamed answer
parse as the whole answer does.

One format object serves one answer: it may remember how far it has looked, so that a long
region is read in linear time however many pieces it arrives in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.server.tools.calls import ToolCall

_DECODER = json.JSONDecoder()
_SPECIAL = re.compile(r'[{}\[\]"]')
_IN_STRING = re.compile(r'["\\]')


@dataclass(frozen=True)
class Region:
    end: int  # where it ends in the buffer (past its start)
    calls: list[ToolCall] | None  # None: not calls; the text is content
    again: bool = False  # a separator was taken: the next call may open with a leading marker


class ToolFormat(Protocol):
    name: str
    markers: tuple[str, ...]  # open a region anywhere
    leading: tuple[str, ...]  # open a region only at the start of the answer (after whitespace)

    def region(self, buf: str, start: int, final: bool, names: Collection[str]) -> Region | None:
        """buf[start:] begins with a marker; None: more text is needed (never when final)."""
        ...


def skip_space(buf: str, i: int) -> int:
    while i < len(buf) and buf[i].isspace():
        i += 1
    return i


class JsonExtent:
    """Where the JSON object or array at buf[start] ends, found incrementally: brackets are
    counted outside strings, each character looked at once across calls."""

    def __init__(self) -> None:
        self._restart(-1)

    def _restart(self, start: int) -> None:
        self.start, self.i, self.depth, self.in_string = start, start, 0, False
        self.found: int | None = None

    def end(self, buf: str, start: int) -> int | None:
        if start != self.start:
            self._restart(start)
        while self.found is None and self.i < len(buf):
            if self.in_string:
                m = _IN_STRING.search(buf, self.i)
                if m is None or m.end() >= len(buf) and m.group() == "\\":
                    self.i = len(buf) if m is None else m.start()
                    return None
                self.i = m.end() + (1 if m.group() == "\\" else 0)
                self.in_string = m.group() == "\\"  # an escape: still inside; a quote: out
                continue
            m = _SPECIAL.search(buf, self.i)
            if m is None:
                self.i = len(buf)
                return None
            self.i = m.end()
            ch = m.group()
            if ch == '"':
                self.in_string = True
            else:
                self.depth += 1 if ch in "{[" else -1
                if self.depth <= 0:
                    self.found = self.i
        return self.found


def decode(buf: str, start: int, end: int) -> Any:
    """The JSON value buf[start:end] holds; None when it is not JSON."""
    try:
        value, stop = _DECODER.raw_decode(buf[:end], start)
    except (ValueError, RecursionError):
        return None
    return value if skip_space(buf[:end], stop) == end else None
