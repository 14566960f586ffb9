"""Deterministic benchmark workloads, shared by every engine we compare.

Stdlib only: the vLLM venv imports this file by path, and it must not need torch
or the tandem package. Each generator returns requests in submission order; the
same arguments always give the same list (one `random.Random(seed)` per call).

Token ids are drawn uniformly from [MIN_TOKEN_ID, vocab_size) so that the low ids,
where our tokenizers keep special tokens, never appear in a prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

MIN_TOKEN_ID = 10


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_new_tokens: int

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "empty prompt"
        assert self.max_new_tokens > 0, self.max_new_tokens


def _check_range(name: str, lo_hi: tuple[int, int]) -> None:
    lo, hi = lo_hi
    if not 0 < lo <= hi:
        raise ValueError(f"{name} must satisfy 0 < lo <= hi, got {lo_hi}")


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(n)]


def throughput_workload(
    n: int = 64,
    prompt_len: tuple[int, int] = (32, 256),
    output_len: tuple[int, int] = (64, 128),
    vocab_size: int = 8192,
    seed: int = 0,
) -> list[Request]:
    """`n` independent requests; lengths uniform in the inclusive ranges given."""
    _check_range("prompt_len", prompt_len)
    _check_range("output_len", output_len)
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size must exceed {MIN_TOKEN_ID}, got {vocab_size}")
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        plen = rng.randint(*prompt_len)
        olen = rng.randint(*output_len)
        requests.append(Request(_tokens(rng, plen, vocab_size), olen))
    return requests


# Named shapes of throughput_workload, the same on both sides of a comparison:
# "throughput" is the mixed workload the vLLM comparison uses; "prefill" and "decode" split it into
# its two phases, to show which one a gap between engines comes from.
SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "throughput": {"prompt_len": (32, 256), "output_len": (64, 128)},
    "prefill": {"prompt_len": (32, 256), "output_len": (1, 1)},
    "decode": {"prompt_len": (16, 16), "output_len": (128, 128)},
}


def named_workload(name: str, n: int = 64, vocab_size: int = 8192, seed: int = 0) -> list[Request]:
    return throughput_workload(n=n, vocab_size=vocab_size, seed=seed, **SHAPES[name])


def shared_prefix_workload(
    num_prefixes: int = 8,
    prefix_len: int = 1024,
    questions_per_prefix: int = 16,
    question_len: tuple[int, int] = (16, 64),
    output_len: tuple[int, int] = (64, 128),
    vocab_size: int = 8192,
    seed: int = 0,
) -> list[Request]:
    """`num_prefixes` long shared prefixes, each followed by distinct short questions.

    Requests are ordered prefix by prefix (all questions on prefix 0, then prefix 1, ...),
    so a prefix cache sees each prefix computed once and then reused.
    """
    _check_range("question_len", question_len)
    _check_range("output_len", output_len)
    if prefix_len <= 0 or vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"bad prefix_len={prefix_len} or vocab_size={vocab_size}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prefixes):
        prefix = _tokens(rng, prefix_len, vocab_size)
        for _ in range(questions_per_prefix):
            question = _tokens(rng, rng.randint(*question_len), vocab_size)
            requests.append(Request(prefix + question, rng.randint(*output_len)))
    return requests


def token_counts(requests: list[Request]) -> tuple[int, int]:
    """(total prompt tokens, total requested new tokens)."""
    return (
        sum(len(r.prompt_token_ids) for r in requests),
        sum(r.max_new_tokens for r in requests),
    )
