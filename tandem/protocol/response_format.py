"""OpenAI's `response_format` on chat completions, and the constraint each type becomes.

`text` is no constraint; `json_object` is any JSON object (the schema {"type": "object"}, as
SGLang maps it); `json_schema` is the client's schema, checked as a schema (schema_check.py),
so a schema that is not one is a 400 naming the problem rather than a grammar the engine fails on.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from tandem.protocol import limits as L
from tandem.protocol.body import Body, Name
from tandem.protocol.schema_check import schema_text

JSON_OBJECT_SCHEMA = '{"type":"object"}'


class TextFormat(Body):
    type: Literal["text"]

    def schema_constraint(self) -> str | None:
        return None


class JsonObjectFormat(Body):
    type: Literal["json_object"]

    def schema_constraint(self) -> str | None:
        return JSON_OBJECT_SCHEMA


class JsonSchemaSpec(Body):
    name: Name
    description: str | None = Field(default=None, max_length=L.MAX_CONSTRAINT_CHARS)
    # "schema" is a BaseModel method's name: the field lives under an alias.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec

    def schema_constraint(self) -> str | None:
        return schema_text(self.json_schema.schema_)


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]
