"""OpenAI's function tools on chat completions: the definitions, `tool_choice`, the calls an
assistant message of the conversation carries, and the constraint a forced choice becomes.

`required` and a named function are enforced by a JSON-schema constraint, never hoped for:
    required     [{"name": <one tool's name>, "parameters": <that tool's schema>}, ...]
                 (anyOf over the tools; minItems 1, maxItems 1 without parallel_tool_calls)
    named        the named function's parameters schema: the output is its arguments
`auto` and `none` constrain nothing (the server parses `auto`'s output in the model's format).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from tandem.protocol import limits as L
from tandem.protocol.body import Body, Name
from tandem.protocol.schema_check import schema_text

ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}
_DEFS_KEYS = ("$defs", "definitions")


class FunctionDef(Body):
    name: Name
    description: str | None = Field(default=None, max_length=L.MAX_CONSTRAINT_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the parameters are checked as a schema in schema_check.py

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters or ANY_OBJECT


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Body):
    name: Name


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(Body):
    """A call in the conversation's history: names and arguments as a model wrote them, which
    need not follow the rule for new definitions (the text counts toward the prompt's bound)."""

    name: str = Field(max_length=L.MAX_ID_CHARS)
    arguments: str = Field(default="", max_length=L.MAX_PROMPT_CHARS)


class MessageToolCall(Body):
    id: str = Field(default="", max_length=L.MAX_ID_CHARS)
    type: Literal["function"] = "function"
    function: CalledFunction

    def template_dict(self) -> dict[str, Any]:
        """As chat templates read it: arguments as an object where they are one (templates
        write them with `tojson`; a string would be quoted twice)."""
        try:
            args: Any = json.loads(self.function.arguments)
        except (ValueError, RecursionError):
            args = self.function.arguments
        if not isinstance(args, dict):
            args = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


def check_tools(tools: list[Tool], choice: ToolChoice | None) -> None:
    """Names unique; a forced choice needs the tool it forces."""
    names = [t.function.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"tools: the function name {dup!r} is defined twice")
    if choice == "required" and not tools:
        raise ValueError("tool_choice 'required' needs tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")


def tool_constraint(tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> str | None:
    """The JSON-schema text a forced choice constrains the output to; None for auto and none."""
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        return schema_text(tool.function.parameters_schema)
    if choice != "required":
        return None
    defs: dict[str, dict[str, Any]] = {}
    items = [_call_item(t.function, defs) for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema_text(schema)


def _call_item(fn: FunctionDef, defs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One tool's call object. Its parameters move under the array: their `$defs` move to the
    root with them, so that "#/$defs/X" references still resolve."""
    params = dict(fn.parameters_schema)
    for key in _DEFS_KEYS:
        if not isinstance(params.get(key), dict):
            continue
        for name, sub in params.pop(key).items():
            if defs.setdefault(key, {}).setdefault(name, sub) != sub:
                raise ValueError(f"tools define {key}/{name} differently; rename one for tool_choice 'required'")
    return {"type": "object", "properties": {"name": {"enum": [fn.name]}, "parameters": params},
            "required": ["name", "parameters"], "additionalProperties": False}
