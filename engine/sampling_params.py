"""Per-request sampling parameters (names follow SGLang / OpenAI).

Every field is checked here, whoever built the request (the HTTP front, the offline Engine, a
test): the sampler turns these values into int64 and float32 tensors, and a value that does not
fit (a top_k of 2**63, a NaN temperature) must be refused with the request, not raise inside a
batch's forward. The bounds are the HTTP layer's (tandem/protocol/limits.py) where both have one.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from numbers import Integral, Real

from tandem.protocol import limits as L

# Below this a temperature is greedy: 1 / temperature would overflow float32 to inf.
GREEDY_TEMPERATURE = 1e-6
CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")
# Deterministic mode's seed for a request that names none (SGLang's default sampling seed): the same
# request draws the same tokens, as greedy ones are the same. Choice i of n takes this seed + i.
DETERMINISTIC_SEED = 42


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary; so is any value >= the vocabulary's size
    min_p: float = 0.0
    # Every request gets a seed, so a sampled sequence is a pure function of
    # (seed, position): reproducible across retraction, re-prefill and overlap.
    seed: int = field(default_factory=lambda: random.getrandbits(31))
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()  # a set: checked against every sampled token
    ignore_eos: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Structured output (SGLang's names): at most one; the grammar backend compiles it
    # (engine/grammar/) and the sampler only draws tokens it allows.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        _int("max_new_tokens", self.max_new_tokens, 0, L.MAX_NEW_TOKENS)
        _real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < _real("top_p", self.top_p) <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if _int("top_k", self.top_k, -1, L.INT64_MAX) == 0:
            raise ValueError("top_k must be -1 or >= 1")
        if not 0.0 <= _real("min_p", self.min_p) <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        _int("seed", self.seed, 0, L.MAX_SEED)
        _int("top_logprobs_num", self.top_logprobs_num, 0, L.INT32_MAX)
        if not isinstance(self.stop, tuple) or not isinstance(self.stop_token_ids, frozenset):
            raise TypeError("stop must be a tuple and stop_token_ids a frozenset (use SamplingParams.make)")
        if len(self.stop) > L.MAX_STOP_STRINGS or not all(
                isinstance(s, str) and 0 < len(s) <= L.MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop must be at most {L.MAX_STOP_STRINGS} non-empty strings of at most "
                             f"{L.MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > L.MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {L.MAX_STOP_TOKEN_IDS} stop_token_ids")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, 0, L.MAX_TOKEN_ID)
        given = [n for n in CONSTRAINTS if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of {', '.join(CONSTRAINTS)} may be set, got {', '.join(given)}")
        for name in given:
            text = getattr(self, name)
            if not isinstance(text, str) or not 0 < len(text) <= L.MAX_CONSTRAINT_CHARS:
                raise ValueError(f"{name} must be a non-empty string of at most {L.MAX_CONSTRAINT_CHARS} characters")
        for name in ("ignore_eos", "return_logprob"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool")

    @classmethod
    def make(cls, **kw: object) -> SamplingParams:
        """Build from user-facing values: a str or list for `stop`, a list for ids."""
        stop = kw.pop("stop", None) or ()
        kw["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)  # type: ignore[arg-type]
        kw["stop_token_ids"] = frozenset(kw.pop("stop_token_ids", None) or ())  # type: ignore[arg-type]
        return cls(**kw)  # type: ignore[arg-type]

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the structured-output constraint, or None."""
        return next(((n, getattr(self, n)) for n in CONSTRAINTS if getattr(self, n) is not None), None)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _int(name: str, value: object, lo: int, hi: int) -> int:
    if not isinstance(value, Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return int(value)


def _real(name: str, value: object) -> float:
    if not isinstance(value, Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)
