"""The grammar-backend contract, run over every registered backend, and the two pieces around
it: the grammar queue (cache, failures, the bounded wait) and the mask handoff between the
scheduler thread and the forward thread."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import torch
from waits import wait_until

from tandem.engine.grammar.backend import GrammarBackend, GrammarError
from tandem.engine.grammar.batch_mask import BatchMask
from tandem.engine.grammar.grammar_queue import GrammarQueue
from tandem.engine.grammar.registry import BACKENDS, create_backend

VOCAB = 8192


@pytest.fixture(scope="module")
def tokenizer(model_path: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path("tiny"))


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tokenizer: Any) -> GrammarBackend:
    return create_backend(request.param, tokenizer, VOCAB, [tokenizer.eos_token_id])


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _allowed(backend: GrammarBackend, matcher: Any) -> torch.Tensor:
    """The tokens the matcher allows next, found by masking a row of zeros."""
    mask = backend.allocate_mask(1)
    matcher.fill_mask(mask, 0)
    logits = torch.zeros(1, VOCAB)
    backend.apply_mask(logits, mask)
    return torch.isfinite(logits[0]).nonzero().flatten()


CASES = {
    "json_schema": (json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                "required": ["ok"], "additionalProperties": False}), '{"ok": true}'),
    "regex": (r"(yes|no)-[0-9]{2}", "no-42"),
    "ebnf": ('root ::= "a" ("b" | "c") "!"', "ac!"),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_matching_text_is_accepted_token_by_token_then_only_the_stop_token(
        backend: GrammarBackend, tokenizer: Any, kind: str) -> None:
    text, sample = CASES[kind]
    m = backend.matcher(backend.compile(kind, text))
    for token in _ids(tokenizer, sample):
        assert token in _allowed(backend, m).tolist()  # the mask allows what the grammar accepts
        assert m.accept(token)
    assert not m.is_terminated()
    assert _allowed(backend, m).tolist() == [tokenizer.eos_token_id]
    assert m.accept(tokenizer.eos_token_id) and m.is_terminated()


def test_a_token_the_grammar_refuses_leaves_the_matcher_unchanged(backend: GrammarBackend, tokenizer: Any) -> None:
    m = backend.matcher(backend.compile("regex", "abc"))
    (x,) = _ids(tokenizer, "x")[:1]
    assert not m.accept(x)
    assert all(m.accept(t) for t in _ids(tokenizer, "abc"))


@pytest.mark.parametrize("kind,text", [
    ("json_schema", "{not json"), ("json_schema", '{"type": "nope"}'), ("regex", "a("),
    ("ebnf", "root ::= "), ("structural_tag", "[]"), ("sql", "select")])
def test_bad_constraints_raise_grammar_error_naming_the_kind(backend: GrammarBackend, kind: str, text: str) -> None:
    with pytest.raises(GrammarError, match=kind):
        backend.compile(kind, text)


@pytest.mark.parametrize("kind,text", [
    ("json_schema", '{"type":"array","items":' * 8000 + '{"type":"integer"}' + "}" * 8000),
    ("ebnf", "root ::= " + "(" * 8000 + '"a"' + ")" * 8000),
    ("regex", "(" * 8000 + "a" + ")" * 8000)])
def test_hostile_nesting_is_refused_not_a_crash(backend: GrammarBackend, kind: str, text: str) -> None:
    """An 8,000-level schema once overflowed the compile thread's stack and killed the process."""
    with pytest.raises(GrammarError, match=kind):
        backend.compile(kind, text)


def test_length_bounded_json_strings_hold_no_control_characters(backend: GrammarBackend, tokenizer: Any) -> None:
    """JSON forbids raw U+0000..U+001F in a string; a maxLength string once allowed them."""
    m = backend.matcher(backend.compile("json_schema", json.dumps({"type": "string", "maxLength": 4})))
    (quote,) = _ids(tokenizer, '"')
    assert m.accept(quote)
    allowed = _allowed(backend, m).tolist()
    assert allowed and not [t for t in allowed if any(ord(c) < 0x20 for c in tokenizer.decode([t]))]


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "string", "maxLength": 8}])
def test_json_strings_are_valid_utf8(backend: GrammarBackend, tokenizer: Any, schema: dict[str, Any]) -> None:
    """The tiny model's vocabulary holds every single byte, so it can spell ED A0 80, the
    three-byte form of the surrogate U+D800: not UTF-8, and it decodes to three replacement
    characters. xgrammar's string class allowed it, and a maxLength 8 string came out 10 long."""
    def spells(bs: bytes) -> bool:
        m = backend.matcher(backend.compile("json_schema", json.dumps(schema)))
        return all(m.accept(_byte_id(tokenizer, b)) for b in b'"' + bs)

    assert spells("€😀".encode())
    assert not spells(b"\xed\xa0\x80") and not spells(b"\xed\xbf\xbf")


def _byte_id(tokenizer: Any, byte: int) -> int:
    """The id of the single-byte token (byte-level BPE writes byte b as one printable char)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return tokenizer.convert_tokens_to_ids(bytes_to_unicode()[byte])


def test_the_queue_caches_grammars_and_failures(tokenizer: Any) -> None:
    q = GrammarQueue("xgrammar", lambda: tokenizer, VOCAB, [tokenizer.eos_token_id], timeout=30)
    key = ("regex", "[ab]+")
    assert q.matcher_now(key) is None
    q.add("r1", key, "item1")
    ready = wait_until(lambda: q.poll()[0], 30, "the grammar to compile")
    assert ready[0][0] == "item1"
    assert q.matcher_now(key) is not None and q.status()["grammar_cache_hits"] == 1
    q.add("r2", ("regex", "("), "bad")
    failed = wait_until(lambda: q.poll()[1], 30, "the compile to fail")
    assert failed[0][0] == "bad" and "regex" in failed[0][1]
    q.shutdown()


def test_a_compile_past_the_timeout_fails_its_request_and_is_dropped_from_the_cache(tokenizer: Any) -> None:
    gate = threading.Event()

    def slow_tokenizer() -> Any:
        gate.wait(10)
        return tokenizer

    q = GrammarQueue("xgrammar", slow_tokenizer, VOCAB, [tokenizer.eos_token_id], timeout=0.05)
    q.add("r", ("regex", "a"), "item")
    failed = wait_until(lambda: q.poll()[1], 10, "the wait to time out")
    assert "took longer than" in failed[0][1] and not q.cache
    gate.set()
    q.shutdown()


def test_the_cache_is_bounded(tokenizer: Any) -> None:
    q = GrammarQueue("xgrammar", lambda: tokenizer, VOCAB, [tokenizer.eos_token_id], cache_size=2)
    for i in range(4):
        q.add(f"r{i}", ("regex", f"a{{{i + 1}}}"), i)
    assert len(q.cache) == 2
    wait_until(lambda: (q.poll(), not q.waiting)[1], 30, "the compiles")
    q.shutdown()


def test_the_forward_thread_waits_for_the_mask_and_a_failure_releases_it(backend: GrammarBackend) -> None:
    m = backend.matcher(backend.compile("regex", "b"))
    results: list[Any] = []

    def forward(mask: BatchMask) -> None:
        logits = torch.zeros(2, VOCAB)
        try:
            mask.apply(logits)
            results.append(torch.isfinite(logits).sum(dim=1).tolist())
        except RuntimeError as exc:
            results.append(exc)

    ok = BatchMask(backend, [m, None])
    t = threading.Thread(target=forward, args=(ok,))
    t.start()
    time.sleep(0.05)  # sleep-ok: the forward thread must be waiting before the mask is filled
    assert not results
    ok.fill()
    t.join(5)
    assert results[0][0] == 1 and results[0][1] == VOCAB  # row 0 constrained, row 1 free
    bad = BatchMask(backend, [m])
    t = threading.Thread(target=forward, args=(bad,))
    t.start()
    bad.fail(ValueError("processing batch N-1 failed"))
    t.join(5)
    assert isinstance(results[1], RuntimeError) and "N-1" in str(results[1])
