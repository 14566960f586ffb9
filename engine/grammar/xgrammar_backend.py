"""The xgrammar backend: JSON schema, regex, EBNF and structural tags, compiled into token-level
automata with a precomputed per-token cache; masks are int32 bitmasks (one bit per token).

JSON is generated compact (no free whitespace between tokens): a grammar that allows any run
of whitespace lets a weak model emit newlines until it reaches max_tokens, and the output is
then cut short and invalid. Compact JSON is the same value.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from tandem.engine.grammar.backend import GrammarBackend, GrammarError, Matcher


class XGrammarMatcher:
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.m = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(mask, row)

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())


# How deep a constraint may nest (JSON levels, EBNF or regex groups). xgrammar's own bound,
# 10,000, is deeper than a thread's C stack: an 8,000-level schema crashed the whole process
# during the compile, and 1,000 levels already give a 27 MB grammar. 128 is twice the HTTP
# body's depth bound (tandem/web/json_body.py), and it covers the offline Engine and raw
# strings (SGLang's json_schema, regex, ebnf), which no body bound sees.
MAX_NESTING = 128


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self._init(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=list(stop_ids) or None))

    @classmethod
    def from_spec(cls, spec: str) -> XGrammarBackend:
        """The compile process's backend: the vocabulary comes as spec() wrote it."""
        backend = cls.__new__(cls)
        backend._init(xgr.TokenizerInfo.deserialize_json(spec))
        return backend

    def _init(self, info: xgr.TokenizerInfo) -> None:
        xgr.set_max_recursion_depth(MAX_NESTING)  # process-wide; every compile is bounded by it
        self.info, self.vocab_size = info, info.vocab_size
        # Our own cache (grammar_cache.py) keys on the constraint text; xgrammar's would
        # hold a second copy of every compiled grammar.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        try:
            if kind == "json_schema":
                json.loads(text)  # a clear message for text that is not JSON at all
                return self.compiler.compile_grammar(json_schema_grammar(text))
            if kind == "regex":
                return self.compiler.compile_regex(text)
            if kind == "ebnf":
                return self.compiler.compile_grammar(text)
            if kind == "structural_tag":
                return self.compiler.compile_structural_tag(text)
        except (ValueError, RuntimeError, TypeError, json.JSONDecodeError) as exc:
            raise GrammarError(f"invalid {kind}: {_first_line(exc)}") from exc
        raise GrammarError(f"unknown constraint kind {kind!r}")

    def matcher(self, compiled: xgr.CompiledGrammar) -> Matcher:
        return XGrammarMatcher(compiled)

    def spec(self) -> str:
        return self.info.serialize_json()

    def serialize(self, compiled: xgr.CompiledGrammar) -> str:
        return compiled.serialize_json()

    def deserialize(self, data: str) -> xgr.CompiledGrammar:
        return xgr.CompiledGrammar.deserialize_json(data, self.info)

    def size_bytes(self, compiled: xgr.CompiledGrammar) -> int:
        return int(compiled.memory_size_bytes)

    def allocate_mask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True),
                                        vocab_size=self.vocab_size)


# xgrammar 0.2.8 writes a string's characters as one of two classes. The length-bounded one
# (minLength / maxLength) lets raw control characters (U+0000..U+001F) in: JSON forbids them,
# and `json.loads` refuses the output. Both let the UTF-16 surrogates U+D800..U+DFFF in, whose
# three-byte forms are not UTF-8: a byte-level vocabulary can spell them, and the text decodes
# to replacement characters (one "character" to the grammar, three to the client's maxLength).
_LOOSE_CHARS = r'[^\"\\\r\n]'
_PLAIN_CHARS = r'[^\0-\x1f\"\\\r\n]'
_JSON_CHARS = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'


def json_schema_grammar(schema: str) -> str:
    """The EBNF of a JSON schema, compact (see the module docstring), with strings of valid
    UTF-8 that never hold a raw control character."""
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return grammar.replace(_PLAIN_CHARS, _JSON_CHARS).replace(_LOOSE_CHARS, _JSON_CHARS)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]
