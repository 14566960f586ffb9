"""What every request body model shares: unknown fields are ignored (as OpenAI's server and vLLM
do, so newer clients keep working), and OpenAI's rule for the names of functions and schemas."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# OpenAI's rule; the name also lands in prompts and in a constraint's enum, so it stays short.
Name = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
