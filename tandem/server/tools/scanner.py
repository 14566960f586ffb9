"""An answer's text, as it arrives, split into content and the calls of one format.

Content goes out as soon as no call marker can begin in it; a call, once its region is
complete. Whitespace at the start of the answer or after a call is held until text follows:
the blank lines around calls are not content, so an answer that is only calls has content
null, streamed or not.
Fed the whole answer at once or in any pieces, the scanner gives the same content and calls.
"""

from __future__ import annotations

from collections.abc import Collection

from tandem.server.markers import find_marker
from tandem.server.tools.calls import ToolCall
from tandem.server.tools.format import Region, ToolFormat


class ToolScanner:
    def __init__(self, fmt: ToolFormat, names: Collection[str]) -> None:
        self.fmt, self.names = fmt, frozenset(names)
        self.buf, self.pos = "", 0
        self.leading = True  # at the start of the answer, or right after a separator
        self.blank = ""  # whitespace not sent yet: it goes out only if text follows
        self.holding = True  # at the start, or right after a call
        self.called = False
        self.waiting = False  # a region opened at pos and needs more text

    def feed(self, text: str) -> list[str | ToolCall]:
        self.buf += text
        return self._scan(final=False)

    def finish(self) -> list[str | ToolCall]:
        out = self._scan(final=True)
        if self.blank and not self.called:
            out.append(self.blank)
        return out

    def _scan(self, final: bool) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        while self.pos < len(self.buf):
            if self.waiting:  # straight back to it: the text before it was scanned already
                if not self._region(out, final):
                    break
                continue
            if self.leading:
                opened = self._leading(out, final)
                if opened is None:
                    break
                if opened:
                    continue
            i, marker = find_marker(self.buf[self.pos:], self.fmt.markers, final)
            self._content(self.buf[self.pos:self.pos + i], out)
            self.pos += i
            if marker is None or not self._region(out, final):
                break
        return out

    def _leading(self, out: list[str | ToolCall], final: bool) -> bool | None:
        """At the start: whether a region opened (and was read); None: wait for more text."""
        start = self.pos
        while start < len(self.buf) and self.buf[start].isspace():
            start += 1
        rest = self.buf[start:start + max(map(len, self.fmt.leading + self.fmt.markers), default=1)]
        opens = any(rest.startswith(m) for m in self.fmt.leading + self.fmt.markers)
        if not final and not opens and any(m.startswith(rest) for m in self.fmt.leading + self.fmt.markers):
            return None  # whitespace only, or the start of a marker
        self._content(self.buf[self.pos:start], out)
        self.pos = start
        if not opens:
            self.leading = False
            return False
        return True if self._region(out, final) else None

    def _region(self, out: list[str | ToolCall], final: bool) -> bool:
        r: Region | None = self.fmt.region(self.buf, self.pos, final, self.names)
        self.waiting = r is None
        if r is None:
            return False
        if r.calls is None:
            self._content(self.buf[self.pos:r.end], out)
        else:
            out.extend(r.calls)
            self.called, self.holding, self.blank = True, True, ""
        self.pos, self.leading = r.end, r.again
        return True

    def _content(self, text: str, out: list[str | ToolCall]) -> None:
        if not text:
            return
        if self.holding and text.isspace():
            self.blank += text
            return
        out.append(self.blank + text)
        self.blank, self.holding = "", False


def parse_text(fmt: ToolFormat, text: str, names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's (content, calls): content None when there are calls and nothing else."""
    scanner = ToolScanner(fmt, names)
    pieces = scanner.feed(text) + scanner.finish()
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    content = "".join(p for p in pieces if isinstance(p, str))
    return (content or None) if calls else content, calls
