"""OpenAI's /v1/chat/completions body: the conversation, tools and response_format.

The worker and the router both render the conversation through the model's chat template
from `template_messages()` and `template_tools()`, so both see the same prompt (the router
keys cache-aware routing on its ids; the output constraint is not part of them).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from tandem.protocol import limits as L
from tandem.protocol.body import Body
from tandem.protocol.openai_api import MaxTokens, SamplingFields
from tandem.protocol.response_format import JsonSchemaFormat, ResponseFormat
from tandem.protocol.tools import MessageToolCall, Tool, ToolChoice, check_tools, tool_constraint


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # null: an assistant turn that only called tools
    name: str | None = Field(default=None, max_length=L.MAX_ID_CHARS)
    tool_calls: list[MessageToolCall] | None = Field(default=None, max_length=L.MAX_TOOL_CALLS)
    tool_call_id: str | None = Field(default=None, max_length=L.MAX_ID_CHARS)

    @model_validator(mode="after")
    def _check(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message cannot carry tool_calls; only an assistant message can")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def chars(self) -> int:
        calls = sum(len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or ())
        return len(self.text()) + calls

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (HF's convention): content always a string,
        since templates concatenate it; calls and their answers under OpenAI's keys."""
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            d["tool_calls"] = [c.template_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=L.MAX_MESSAGES)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=L.MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=L.MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # OpenAI's default: "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        check_tools(self.tools or [], self.tool_choice)
        tools_chars = len(json.dumps(self.template_tools() or [])) if self.tools else 0
        if sum(m.chars() for m in self.messages) + tools_chars > L.MAX_PROMPT_CHARS:
            raise ValueError(f"the messages' and tools' text exceeds {L.MAX_PROMPT_CHARS} characters")
        return self

    def constraint_fields(self) -> dict[str, tuple[str, str]]:
        found = super().constraint_fields()
        schema = self.response_format.schema_constraint() if self.response_format is not None else None
        if schema is not None:
            found["response_format"] = ("json_schema", schema)
        forced = tool_constraint(self.tools or [], self.tool_choice, self.parallel_tool_calls)
        if forced is not None:
            found["tool_choice"] = ("json_schema", forced)
        return found

    def schema_fields(self) -> list[tuple[str, Any, str | None]]:
        found: list[tuple[str, Any, str | None]] = [
            (f"tools[{i}].function.parameters", t.function.parameters, None)
            for i, t in enumerate(self.tools or []) if t.function.parameters is not None]
        if isinstance(self.response_format, JsonSchemaFormat):
            found.append(("response_format.json_schema.schema", self.response_format.json_schema.schema_, None))
        return found + super().schema_fields()

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def effective_tool_choice(self) -> ToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def offered_tools(self) -> list[Tool]:
        """The tools the prompt shows and the output may call: none under tool_choice "none"
        (as SGLang does), so the model is not tempted into a call it may not make."""
        return [] if self.effective_tool_choice == "none" else list(self.tools or [])

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.offered_tools] or None
