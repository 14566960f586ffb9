"""Per-request sampling parameters (names follow SGLang / OpenAI)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    min_p: float = 0.0
    # Every request gets a seed, so a sampled sequence is a pure function of
    # (seed, position): reproducible across retraction, re-prefill and overlap.
    seed: int = field(default_factory=lambda: random.getrandbits(31))
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError("top_k must be -1 or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if self.top_logprobs_num < 0:
            raise ValueError("top_logprobs_num must be >= 0")
        if not isinstance(self.stop, tuple) or not isinstance(self.stop_token_ids, tuple):
            raise TypeError("stop and stop_token_ids must be tuples (use SamplingParams.make)")

    @classmethod
    def make(cls, **kw: object) -> SamplingParams:
        """Build from user-facing values: a str or list for `stop`, a list for ids."""
        stop = kw.pop("stop", None) or ()
        kw["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)  # type: ignore[arg-type]
        kw["stop_token_ids"] = tuple(kw.pop("stop_token_ids", None) or ())  # type: ignore[arg-type]
        return cls(**kw)  # type: ignore[arg-type]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
