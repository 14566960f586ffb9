"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2/3): one JSON object per block,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several blocks for parallel calls, text around them is content. The object is read to its
closing brace (a "</tool_call>" inside one of its strings does not end the block). A block
that is not a call of an offered tool stays in the content as written, through its first
</tool_call>; a block never closed, to the end."""

from __future__ import annotations

from collections.abc import Collection

from tandem.server.tools.calls import call_from_json
from tandem.server.tools.format import JsonExtent, Region, decode, skip_space

START, END = "<tool_call>", "</tool_call>"


class HermesFormat:
    name = "hermes"
    markers = (START,)
    leading = ()

    def __init__(self) -> None:
        self.extent = JsonExtent()
        self.start, self.searched = -1, 0

    def region(self, buf: str, start: int, final: bool, names: Collection[str]) -> Region | None:
        i = skip_space(buf, start + len(START))
        if i < len(buf) and buf[i] == "{":
            end = self.extent.end(buf, i)
            if end is None:
                return Region(len(buf), None) if final else None
            j = skip_space(buf, end)
            if buf.startswith(END, j):
                call = call_from_json(decode(buf, i, end), names)
                if call is not None:
                    return Region(j + len(END), [call])
            elif not final and END.startswith(buf[j:j + len(END)]) and len(buf) - j < len(END):
                return None  # the block may still close right here
        elif i == len(buf) and not final:
            return None
        return self._not_a_call(buf, start, final)

    def _not_a_call(self, buf: str, start: int, final: bool) -> Region | None:
        """Content through the block's first </tool_call> (searched once across calls)."""
        if start != self.start:
            self.start, self.searched = start, start + len(START)
        close = buf.find(END, self.searched)
        if close == -1:
            self.searched = max(len(buf) - len(END) + 1, self.searched)
            return Region(len(buf), None) if final else None
        return Region(close + len(END), None)
