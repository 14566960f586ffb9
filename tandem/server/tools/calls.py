"""A tool call as the parsers find it, and as OpenAI's responses carry it.

Only a call of an offered tool counts: a model's JSON that merely looks like a call
({"name": "Bob", ...} in an answer about people) stays content."""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class CallDelta:
    """One piece of a streamed call: the first piece of call `index` names it (id, name); the
    concatenated `arguments` of its pieces are its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            fn = {"name": self.name, **fn}
        return {**out, "function": fn}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def arguments_text(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


def call_from_json(obj: Any, names: Collection[str], args_keys: tuple[str, ...] = ("arguments", "parameters")
                   ) -> ToolCall | None:
    """{"name": <an offered tool>, "arguments" | "parameters": {...}} as a call, else None. Some
    models write the arguments as a JSON string; an absent one is a call without arguments."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    key = next((k for k in args_keys if k in obj), None)
    args = obj[key] if key is not None else {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], arguments_text(args))


def merge_calls(deltas: list[CallDelta]) -> list[dict[str, Any]]:
    """A response's message.tool_calls from its pieces (what a client's stream accumulation does)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
        calls[d.index]["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]
