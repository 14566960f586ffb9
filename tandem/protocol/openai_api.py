"""HTTP request bodies shared by the worker and the router: OpenAI completions and chat,
and SGLang's native `/generate`. Each is validated here, once: a body that parses is a
body the engine accepts, so the servers answer bad input with 400 before any work.

Field names and defaults follow OpenAI (and vLLM/SGLang for their extensions: top_k,
min_p, ignore_eos, stop_token_ids). Unknown fields are ignored, as OpenAI's own
server and vLLM do, so newer clients keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NonNeg = Annotated[int, Field(ge=0)]
TokenIds = list[NonNeg]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Bootstrap(_Body):
    """PD routing (SGLang's fields): the router sends the same body to a prefill and a
    decode worker; the room names the request on both. Job i of a batch or of `n`
    choices is room + i on both sides."""

    bootstrap_host: str | None = None
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    bootstrap_room: int | None = Field(default=None, ge=0, lt=2**63)

    def bootstrap(self) -> dict[str, Any]:
        return {"bootstrap_host": self.bootstrap_host, "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": self.bootstrap_room}


class _Sampling(_Bootstrap):
    """What completions and chat share."""

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNeg] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("top_k must be -1 (whole vocabulary) or >= 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop must be at most 16 non-empty strings")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> _Sampling:
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported; send 0")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

    def sampling(self, max_new_tokens: int, index: int, top_logprobs: int | None) -> dict[str, Any]:
        """Engine SamplingParams kwargs for choice `index` (each choice of n gets its own seed)."""
        sp: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": self.ignore_eos}
        for name in ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids"):
            if getattr(self, name) is not None:
                sp[name] = getattr(self, name)
        if self.seed is not None:
            sp["seed"] = (self.seed + index) % 2**31
        if top_logprobs is not None:
            sp["return_logprob"], sp["top_logprobs_num"] = True, top_logprobs
        return sp

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported (leave it unset or equal to n)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs needs prompt logprobs, which are not supported")
        if self.prompt == [] or self.prompt == "":
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: one text or token-id list per prompt."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.tools:
            raise ValueError("tools are not supported by this server")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ValueError("only response_format type 'text' is supported")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class GenerateSampling(BaseModel):
    """SGLang's sampling_params, the subset this engine runs; any other key is a 400."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int = Field(default=128, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNeg] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    skip_special_tokens: bool = True

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0:
            raise ValueError("top_k must be -1 (whole vocabulary) or >= 1")
        return v

    def engine_kwargs(self) -> dict[str, Any]:
        return self.model_dump(exclude={"skip_special_tokens"}, exclude_none=True)


class GenerateRequest(_Bootstrap):
    """SGLang's native /generate (what sgl-router forwards to a worker)."""

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    logprob_start_len: int = -1
    rid: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        if self.text == "" or self.text == [] or self.input_ids == []:
            raise ValueError("the prompt is empty")
        if self.is_batch and self.stream:
            raise ValueError("streaming is for one prompt at a time")
        return self

    @property
    def is_batch(self) -> bool:
        return isinstance(self.text, list) or bool(self.input_ids and isinstance(self.input_ids[0], list))

    def prompts(self) -> list[str | list[int]]:
        if self.text is not None:
            return list(self.text) if isinstance(self.text, list) else [self.text]
        assert self.input_ids is not None
        return list(self.input_ids) if self.is_batch else [self.input_ids]  # type: ignore[list-item]
