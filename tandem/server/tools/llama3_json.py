"""Llama 3.x's JSON calls: the answer is the call, optionally after <|python_tag|>,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

several separated by ';' for parallel calls. <|python_tag|> is a special token, so with the
default skip_special_tokens it is not in the text: the object at the start of the answer is
read as a call when it is one (an offered tool's name, an object of arguments)."""

from __future__ import annotations

from collections.abc import Collection

from tandem.server.tools.calls import call_from_json
from tandem.server.tools.format import JsonExtent, Region, decode, skip_space

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonFormat:
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    leading = ("{",)

    def __init__(self) -> None:
        self.extent = JsonExtent()

    def region(self, buf: str, start: int, final: bool, names: Collection[str]) -> Region | None:
        i = skip_space(buf, start + len(PYTHON_TAG)) if buf.startswith(PYTHON_TAG, start) else start
        if i == len(buf) or buf[i] != "{":
            if i == len(buf) and not final:
                return None
            return Region(i if i > start else len(buf), None)  # a tag and no object: the tag is content
        end = self.extent.end(buf, i)
        if end is None:
            return Region(len(buf), None) if final else None
        call = call_from_json(decode(buf, i, end), names)
        if call is None:
            return Region(end, None)
        after = skip_space(buf, end)
        if after == len(buf) and not final:
            return None  # a ';' and another call may follow
        if after < len(buf) and buf[after] == ";":
            return Region(after + 1, [call], again=True)
        return Region(end, [call])
