"""`--reasoning-parser`: a thinking model's <think>...</think> as message.reasoning_content.

    qwen3        reasoning only when the answer opens with <think> (Qwen3 writes it itself)
    deepseek-r1  reasoning from the start (R1's template puts <think> in the prompt) up to
                 </think>; an answer that never closes it is all reasoning

What follows </think> is the content, its leading blank lines dropped. Fed the whole answer at
once or in any pieces, the split is the same (markers.py)."""

from __future__ import annotations

from tandem.server.markers import find_marker

START, END = "<think>", "</think>"
REASONING_PARSERS = {"qwen3": False, "deepseek-r1": True}  # name -> reasoning from the start


class ReasoningSplitter:
    def __init__(self, forced: bool) -> None:
        self.forced = forced
        self.buf, self.pos = "", 0
        self.state = "open"  # open -> thinking -> after -> answer; or open -> answer

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that `text` settles."""
        self.buf += text
        reasoning, content = "", ""
        if self.state == "open":
            self._open(final)
        if self.state == "thinking":
            i, marker = find_marker(self.buf[self.pos:], (END,), final)
            reasoning, self.pos = self.buf[self.pos:self.pos + i], self.pos + i
            if marker is not None:
                self.pos, self.state = self.pos + len(END), "after"
        if self.state == "after":
            rest = self.buf[self.pos:]
            self.pos += len(rest) - len(rest.lstrip())
            if self.pos < len(self.buf):
                self.state = "answer"
        if self.state == "answer":
            content, self.pos = self.buf[self.pos:], len(self.buf)
        self.buf, self.pos = self.buf[self.pos:], 0  # what is settled is never read again
        return reasoning, content

    def _open(self, final: bool) -> None:
        rest = self.buf.lstrip()
        if rest.startswith(START):
            self.pos, self.state = len(self.buf) - len(rest) + len(START), "thinking"
        elif final or not START.startswith(rest):
            self.state = "thinking" if self.forced else "answer"
