"""`tandem bench` workloads: text prompts any OpenAI-compatible server accepts.

Every workload is a list of sessions; a session is one or more user turns sent in order
(multi-turn chat resends the history with each turn, as a chat UI does). Single-turn
workloads have one turn per session. The same spec and seed always give the same list,
so both sides of a comparison see identical requests.

Prompts are built from a fixed word list. A word is about one to two tokens for common
tokenizers; the report counts tokens from the server's `usage`, never from the words.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORKLOADS = ("random", "sharegpt", "shared_prefix", "multi_turn", "long_context")

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there one all we their been has would when if will so no what up said about into than them "
    "can only other time new some could these two may first then do any like my now over such our man me even most "
    "made after also did many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since against go came right "
    "used take three system model server request token cache batch prefix decode kernel memory page schedule router"
).split()


@dataclass(frozen=True)
class Turn:
    text: str
    max_tokens: int


@dataclass(frozen=True)
class Session:
    turns: tuple[Turn, ...]
    system: str | None = None  # a shared system prompt (shared_prefix), sent as a prefix or a system message


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "random"
    num: int = 100  # sessions
    prompt: tuple[int, int] = (64, 512)  # words per user turn, inclusive range (random, multi_turn)
    output: tuple[int, int] = (32, 256)  # max_tokens, inclusive range
    tenants: int = 8  # shared_prefix: distinct system prompts
    prefix: int = 512  # shared_prefix: words in each system prompt
    turns: int = 4  # multi_turn: turns per session
    context: int = 1500  # long_context: words per prompt
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.kind!r}")
        for name in ("prompt", "output"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name} range must satisfy 0 < lo <= hi, got {lo}:{hi}")
        if min(self.num, self.tenants, self.prefix, self.turns, self.context) < 1:
            raise ValueError("counts and lengths must be at least 1")


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(math.exp(rng.gauss(math.log(median), sigma)))))


def build(spec: WorkloadSpec) -> list[Session]:
    rng = random.Random(spec.seed)
    out_len = lambda: rng.randint(*spec.output)  # noqa: E731
    if spec.kind == "random":
        return [Session((Turn(_text(rng, rng.randint(*spec.prompt)), out_len()),)) for _ in range(spec.num)]
    if spec.kind == "sharegpt":
        # ShareGPT's shape: long-tailed prompts (median ~100 tokens) and replies (median ~130),
        # clipped to the spec's upper bounds so a small model's context still holds them.
        return [Session((Turn(_text(rng, _lognormal(rng, 80, 1.0, 4, spec.prompt[1])),
                              _lognormal(rng, 130, 0.8, 4, spec.output[1])),)) for _ in range(spec.num)]
    if spec.kind == "shared_prefix":
        systems = [_text(rng, spec.prefix) for _ in range(spec.tenants)]
        # Tenants' traffic is skewed (Zipf-like), as in a real multi-tenant deployment.
        weights = [1 / (i + 1) for i in range(spec.tenants)]
        return [Session((Turn(_text(rng, rng.randint(*spec.prompt)), out_len()),),
                        system=rng.choices(systems, weights)[0]) for _ in range(spec.num)]
    if spec.kind == "multi_turn":
        return [Session(tuple(Turn(_text(rng, rng.randint(*spec.prompt)), out_len()) for _ in range(spec.turns)))
                for _ in range(spec.num)]
    return [Session((Turn(_text(rng, spec.context), out_len()),)) for _ in range(spec.num)]  # long_context
