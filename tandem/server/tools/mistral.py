"""Mistral's calls: a JSON array after the [TOOL_CALLS] marker,

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

[TOOL_CALLS] is a special token in Mistral's tokenizers, so with the default
skip_special_tokens it is not in the text: an array at the start of the answer is read as
calls when every item is a call of an offered tool."""

from __future__ import annotations

from collections.abc import Collection

from tandem.server.tools.calls import call_from_json
from tandem.server.tools.format import JsonExtent, Region, decode, skip_space

TOOL_CALLS = "[TOOL_CALLS]"


class MistralFormat:
    name = "mistral"
    markers = (TOOL_CALLS,)
    leading = ("[",)

    def __init__(self) -> None:
        self.extent = JsonExtent()

    def region(self, buf: str, start: int, final: bool, names: Collection[str]) -> Region | None:
        i = skip_space(buf, start + len(TOOL_CALLS)) if buf.startswith(TOOL_CALLS, start) else start
        if i == len(buf) or buf[i] != "[":
            if i == len(buf) and not final:
                return None
            return Region(i if i > start else len(buf), None)
        end = self.extent.end(buf, i)
        if end is None:
            return Region(len(buf), None) if final else None
        items = decode(buf, i, end)
        calls = [call_from_json(x, names) for x in items] if isinstance(items, list) and items else [None]
        if any(c is None for c in calls):
            return Region(end, None)
        return Region(end, calls)  # type: ignore[arg-type]
