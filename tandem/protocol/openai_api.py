"""HTTP request bodies shared by the worker and the router: OpenAI completions (chat is in
chat_api.py) and SGLang's native `/generate`. Each is validated here, once: a body that parses is a
body the engine accepts, so the servers answer bad input with 400 before any work.

Field names and defaults follow OpenAI (and vLLM/SGLang for their extensions: top_k,
min_p, ignore_eos, stop_token_ids). Unknown fields are ignored, as OpenAI's own
server and vLLM do, so newer clients keep working. Every number, list and string has an
upper bound (limits.py): no value a client sends can overflow what the engine builds from it.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from tandem.protocol import limits as L
from tandem.protocol.body import Body
from tandem.protocol.bootstrap import Bootstrap
from tandem.protocol.schema_budget import charge_all
from tandem.protocol.schema_check import CONSTRAINT_KINDS, Schemas, parse_schema_string

# Prompt ids are checked against the vocabulary by the front, with a clearer message than a
# bound here would give inside the prompt's union of shapes.
NonNeg = Annotated[int, Field(ge=0)]
TokenIds = list[NonNeg]
TokenId = Annotated[int, Field(ge=0, le=L.MAX_TOKEN_ID)]


def _top_k(v: int | None) -> int | None:
    if v == 0:
        raise ValueError("top_k must be -1 (whole vocabulary) or >= 1")
    return v


def _stop(v: str | list[str] | None) -> str | list[str] | None:
    stops = [v] if isinstance(v, str) else v or []
    if len(stops) > L.MAX_STOP_STRINGS or any(not s or len(s) > L.MAX_STOP_CHARS for s in stops):
        raise ValueError(f"stop must be at most {L.MAX_STOP_STRINGS} non-empty strings of at most "
                         f"{L.MAX_STOP_CHARS} characters")
    return v


def _check_prompts(prompts: list[str | list[int]]) -> None:
    """Bounds before tokenizing: the batch's size and its text."""
    if len(prompts) > L.MAX_PROMPTS:
        raise ValueError(f"at most {L.MAX_PROMPTS} prompts per request")
    if sum(len(p) for p in prompts if isinstance(p, str)) > L.MAX_PROMPT_CHARS:
        raise ValueError(f"the prompt text exceeds {L.MAX_PROMPT_CHARS} characters")


Temperature = Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1, le=L.MAX_TOP_K), AfterValidator(_top_k)]
MaxTokens = Annotated[int, Field(ge=0, le=L.MAX_NEW_TOKENS)]
Seed = Annotated[int, Field(ge=0, le=L.MAX_SEED)]
Stop = Annotated[str | list[str] | None, AfterValidator(_stop)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=L.MAX_STOP_TOKEN_IDS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
Constraint = Annotated[str, Field(min_length=1, max_length=L.MAX_CONSTRAINT_CHARS)]


def _parses(text: str) -> str:
    """JSON, here; a schema, once the budget of all the body's schemas allows (schema_check.py)."""
    parse_schema_string(text, "json_schema")
    return text


SchemaString = Annotated[Constraint, AfterValidator(_parses)]


def _string_schemas(text: str | None, what: str) -> list[tuple[str, Any, str | None]]:
    """SGLang's json_schema, for schema_check: the engine compiles the text as it came."""
    return [] if text is None else [(what, parse_schema_string(text, what), text)]


class StreamOptions(Body):
    include_usage: bool = False


class SamplingFields(Bootstrap):
    """What completions and chat share."""

    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    n: int = Field(default=1, ge=1, le=L.MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    stop_token_ids: StopTokenIds | None = None
    seed: Seed | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # vLLM's extra parameter: False keeps <|im_end|> and kin in the text
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # Refused when not empty (below); bounded anyway, so no field of a body is unbounded.
    logit_bias: dict[Annotated[str, Field(max_length=20)], Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        default=None, max_length=L.MAX_LOGIT_BIAS)  # token ids as strings -> OpenAI's bias range
    user: str | None = Field(default=None, max_length=L.MAX_ID_CHARS)
    # SGLang's structured-output extras: the engine constrains the output to one of them.
    json_schema: SchemaString | None = None
    regex: Constraint | None = None
    ebnf: Constraint | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> SamplingFields:
        _ = self.schemas  # charged as they are read, first: a forced tool choice joins them below
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported; send 0")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        given = self.constraint_sources
        if len(given) > 1:
            raise ValueError(f"at most one output constraint per request, got {', '.join(given)}")
        for field, (_, text) in given.items():
            if len(text) > L.MAX_CONSTRAINT_CHARS:
                raise ValueError(f"the constraint from {field} is {len(text)} characters; "
                                 f"at most {L.MAX_CONSTRAINT_CHARS}")
        return self

    @cached_property
    def constraint_sources(self) -> dict[str, tuple[str, str]]:
        """Each field that constrains the output -> (engine kind, text); valid requests have <= 1.
        Computed once: a forced tool choice's schema is built from every tool's."""
        return self.constraint_fields()

    def constraint_fields(self) -> dict[str, tuple[str, str]]:
        return {k: (k, getattr(self, k)) for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None}

    @cached_property
    def schemas(self) -> Schemas:
        """Every JSON Schema of the body with its text, for schema_check; reading them the first
        time, while the body is validated, charges them to the request's budget."""
        return charge_all(self.schema_fields())

    def schema_fields(self) -> list[tuple[str, Any, str | None]]:
        """(field, schema, its text when the client sent one)."""
        return _string_schemas(self.json_schema, "json_schema")

    def sampling(self, max_new_tokens: int, index: int, top_logprobs: int | None,
                 default_seed: int | None = None) -> dict[str, Any]:
        """Engine SamplingParams kwargs for choice `index` (each choice of n gets its own seed);
        `default_seed` stands in for a seed the body does not name (deterministic mode's)."""
        sp: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": self.ignore_eos}
        for name in ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids"):
            if getattr(self, name) is not None:
                sp[name] = getattr(self, name)
        seed = self.seed if self.seed is not None else default_seed
        if seed is not None:
            sp["seed"] = (seed + index) % 2**31
        if top_logprobs is not None:
            sp["return_logprob"], sp["top_logprobs_num"] = True, top_logprobs
        sp.update(dict(self.constraint_sources.values()))
        return sp

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: MaxTokens | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=L.MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=L.MAX_N)

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported (leave it unset or equal to n)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs needs prompt logprobs, which are not supported")
        if self.prompt == [] or self.prompt == "":
            raise ValueError("prompt must not be empty")
        _check_prompts(self.prompts())
        if len(self.prompts()) * self.n > L.MAX_CHOICES:
            raise ValueError(f"prompts x n must be at most {L.MAX_CHOICES} (MAX_CHOICES)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: one text or token-id list per prompt."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class GenerateSampling(BaseModel):
    """SGLang's sampling_params, the subset this engine runs; any other key is a 400."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: MaxTokens = 128
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    stop: Stop = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    seed: Seed | None = None
    skip_special_tokens: bool = True
    json_schema: SchemaString | None = None
    regex: Constraint | None = None
    ebnf: Constraint | None = None
    structural_tag: Constraint | None = None

    @model_validator(mode="after")
    def _at_most_one_constraint(self) -> GenerateSampling:
        _ = self.schemas
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of {', '.join(CONSTRAINT_KINDS)} may be set, got {', '.join(given)}")
        return self

    @property
    def constraint(self) -> str | None:
        return next((k for k in CONSTRAINT_KINDS if getattr(self, k) is not None), None)

    @cached_property
    def schemas(self) -> Schemas:
        return charge_all(_string_schemas(self.json_schema, "sampling_params.json_schema"))

    def engine_kwargs(self) -> dict[str, Any]:
        return self.model_dump(exclude={"skip_special_tokens"}, exclude_none=True)


class GenerateRequest(Bootstrap):
    """SGLang's native /generate (what sgl-router forwards to a worker)."""

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=L.MAX_TOP_LOGPROBS)
    logprob_start_len: int = Field(default=-1, ge=-1, le=L.INT32_MAX)
    rid: str | None = Field(default=None, min_length=1, max_length=L.MAX_ID_CHARS)

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        if self.text == "" or self.text == [] or self.input_ids == []:
            raise ValueError("the prompt is empty")
        if self.is_batch and self.stream:
            raise ValueError("streaming is for one prompt at a time")
        _check_prompts(self.prompts())
        return self

    @property
    def schemas(self) -> Schemas:
        return self.sampling_params.schemas

    @property
    def is_batch(self) -> bool:
        return isinstance(self.text, list) or bool(self.input_ids and isinstance(self.input_ids[0], list))

    def prompts(self) -> list[str | list[int]]:
        if self.text is not None:
            return list(self.text) if isinstance(self.text, list) else [self.text]
        assert self.input_ids is not None  # invariant: the model's validator requires text or input_ids
        return list(self.input_ids) if self.is_batch else [self.input_ids]  # type: ignore[list-item]
