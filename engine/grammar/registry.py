"""The grammar backends by name (`--grammar-backend`). Importing this needs no torch and no
backend library: EngineConfig checks names here, and a backend loads when first built."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tandem.engine.grammar.backend import GrammarBackend

# name -> factory(tokenizer, vocab_size, stop_token_ids)
BackendFactory = Callable[[Any, int, Sequence[int]], GrammarBackend]
# name -> factory(spec): the compile process's backend (GrammarBackend.spec)
SpecFactory = Callable[[str], GrammarBackend]


def _xgrammar(tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> GrammarBackend:
    from tandem.engine.grammar.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size, stop_ids)


def _xgrammar_spec(spec: str) -> GrammarBackend:
    from tandem.engine.grammar.xgrammar_backend import XGrammarBackend

    return XGrammarBackend.from_spec(spec)


BACKENDS: dict[str, BackendFactory] = {"xgrammar": _xgrammar}
FROM_SPEC: dict[str, SpecFactory] = {"xgrammar": _xgrammar_spec}


def create_backend(name: str, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> GrammarBackend:
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(f"grammar_backend must be one of {sorted(BACKENDS)}, got {name!r}") from None
    return factory(tokenizer, vocab_size, stop_ids)


def create_from_spec(name: str, spec: str) -> GrammarBackend:
    return FROM_SPEC[name](spec)
