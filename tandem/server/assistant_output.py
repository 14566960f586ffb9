"""An assistant choice's text as OpenAI's message: reasoning, content and tool calls.

The reasoning parser (--reasoning-parser) takes <think>...</think> off first; what remains goes
to the tool-call source of the request's tool_choice (tools/choice_calls.py). Streamed, each
piece of text gives a `ChatDelta` with what it settles; not streamed, the whole text gives
one. Either way the same code decides, so the two answers agree.

A constrained answer (response_format, a forced tool choice, SGLang's regex/ebnf/json_schema)
is not split for reasoning: the constraint shaped it from its first token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.protocol.chat_api import ChatCompletionRequest
from tandem.protocol.tools import NamedToolChoice
from tandem.server.reasoning import REASONING_PARSERS, ReasoningSplitter
from tandem.server.tools.calls import CallDelta, merge_calls
from tandem.server.tools.choice_calls import AutoCalls, CallSource, NamedCall, RequiredCalls
from tandem.server.tools.registry import FORMATS


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        """A stream chunk's delta: only the keys with something in them."""
        d: dict[str, Any] = {}
        if self.reasoning:
            d["reasoning_content"] = self.reasoning
        if self.content:
            d["content"] = self.content
        if self.calls:
            d["tool_calls"] = [c.to_openai() for c in self.calls]
        return d


class AssistantParser:
    def __init__(self, reasoning: ReasoningSplitter | None, calls: CallSource | None) -> None:
        self.reasoning, self.calls = reasoning, calls
        self.called = False

    @property
    def plain(self) -> bool:
        """Text goes out as it comes: content only, never null."""
        return self.reasoning is None and self.calls is None

    def feed(self, text: str, final: bool) -> ChatDelta:
        out = ChatDelta()
        if self.reasoning is not None:
            out.reasoning, text = self.reasoning.feed(text, final)
        if self.calls is None:
            out.content = text
            return out
        pieces = self.calls.feed(text) if text else []
        if final:
            pieces += self.calls.finish()
        out.content = "".join(p for p in pieces if isinstance(p, str))
        out.calls = [p for p in pieces if isinstance(p, CallDelta)]
        self.called = self.called or bool(out.calls)
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.called else reason

    def message(self, whole: ChatDelta) -> dict[str, Any]:
        """The non-streamed message from the whole text's delta."""
        msg: dict[str, Any] = {"role": "assistant", "content": whole.content}
        if not self.plain:
            msg["content"] = whole.content or None
        if self.reasoning is not None:
            msg["reasoning_content"] = whole.reasoning or None
        if whole.calls:
            msg["tool_calls"] = merge_calls(whole.calls)
        return msg


def assistant_parser(body: ChatCompletionRequest, tool_format: str, reasoning_parser: str | None
                     ) -> AssistantParser:
    """A fresh parser for one choice of `body`."""
    choice = body.effective_tool_choice
    names = [t.function.name for t in body.offered_tools]
    calls: CallSource | None = None
    if isinstance(choice, NamedToolChoice):
        calls = NamedCall(choice.function.name)
    elif choice == "required":
        calls = RequiredCalls(names)
    elif choice == "auto" and names:
        calls = AutoCalls(FORMATS[tool_format](), names)
    reasoning = None
    if reasoning_parser is not None and not body.constraint_sources:
        reasoning = ReasoningSplitter(REASONING_PARSERS[reasoning_parser])
    return AssistantParser(reasoning, calls)
