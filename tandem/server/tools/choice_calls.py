"""How one choice's text becomes content and calls, under the request's tool_choice:

    auto       the model's format, scanned as the text arrives (scanner.py)
    required   the constraint made the text a JSON array of {"name", "parameters"}: read at the end
    named      the constraint made the text the function's arguments: streamed as they come

Each gives content pieces and CallDeltas; the response's message is their sum, so a streamed
answer accumulates to the non-streamed one.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Protocol

from tandem.server.tools.calls import CallDelta, ToolCall, call_from_json, new_call_id
from tandem.server.tools.format import ToolFormat
from tandem.server.tools.scanner import ToolScanner

Piece = str | CallDelta


class CallSource(Protocol):
    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


class _Numbered:
    def __init__(self) -> None:
        self.count = 0

    def delta(self, call: ToolCall) -> CallDelta:
        self.count += 1
        return CallDelta(self.count - 1, call.arguments, id=new_call_id(), name=call.name)


class AutoCalls:
    def __init__(self, fmt: ToolFormat, names: Collection[str]) -> None:
        self.scanner, self.numbered = ToolScanner(fmt, names), _Numbered()

    def feed(self, text: str) -> list[Piece]:
        return self._number(self.scanner.feed(text))

    def finish(self) -> list[Piece]:
        return self._number(self.scanner.finish())

    def _number(self, pieces: list[str | ToolCall]) -> list[Piece]:
        return [p if isinstance(p, str) else self.numbered.delta(p) for p in pieces]


class RequiredCalls:
    """The array is only whole at the end; text that is not one (cut short by max_tokens) is content."""

    def __init__(self, names: Collection[str]) -> None:
        self.names, self.text = frozenset(names), ""

    def feed(self, text: str) -> list[Piece]:
        self.text += text
        return []

    def finish(self) -> list[Piece]:
        try:
            items = json.loads(self.text)
        except (ValueError, RecursionError):
            items = None
        calls = [call_from_json(x, self.names, ("parameters",)) for x in items] if isinstance(items, list) else []
        if not calls or any(c is None for c in calls):
            return [self.text] if self.text else []
        numbered = _Numbered()
        return [numbered.delta(c) for c in calls if c is not None]


class NamedCall:
    def __init__(self, name: str) -> None:
        self.name, self.started = name, False

    def feed(self, text: str) -> list[Piece]:
        if self.started:
            return [CallDelta(0, text)] if text else []
        self.started = True
        return [CallDelta(0, text, id=new_call_id(), name=self.name)]

    def finish(self) -> list[Piece]:
        return [] if self.started else self.feed("")
