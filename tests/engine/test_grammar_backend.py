"""The grammar-backend contract, run over every registered backend, and the two pieces around
it: the grammar queue (cache, failures, the bounded wait) and the mask handoff between the
scheduler thread and the forward thread."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from waits import wait_until

from tandem.engine.grammar.backend import GrammarBackend, GrammarError
from tandem.engine.grammar.batch_mask import BatchMask
from tandem.engine.grammar.compile_pool import PoolLimits
from tandem.engine.grammar.grammar_cache import FAILURE_TTL, MAX_FAILURES, GrammarCache
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


def test_a_grammar_crosses_to_another_process_and_back(backend: GrammarBackend, tokenizer: Any) -> None:
    """The compile process builds its backend from spec() and hands back serialize()'s text."""
    from tandem.engine.grammar.registry import create_from_spec

    name = next(n for n in BACKENDS if isinstance(backend, type(create_backend(n, tokenizer, VOCAB, []))))
    child = create_from_spec(name, backend.spec())
    compiled = child.compile("regex", "(yes|no)-[0-9]{2}")
    assert child.size_bytes(compiled) > 0
    m = backend.matcher(backend.deserialize(child.serialize(compiled)))
    assert all(m.accept(t) for t in _ids(tokenizer, "no-42"))
    assert _allowed(backend, m).tolist() == [tokenizer.eos_token_id]


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


def _queue(tokenizer: Any, **kw: Any) -> GrammarQueue:
    return GrammarQueue("xgrammar", lambda: tokenizer, VOCAB, [tokenizer.eos_token_id], **kw)


def _settled(q: GrammarQueue, timeout: float = 60) -> tuple[list[Any], list[Any]]:
    """Poll until nothing waits; every ready and failed item."""
    ready: list[Any] = []
    failed: list[Any] = []

    def step() -> bool:
        r, f = q.poll()
        ready.extend(r)
        failed.extend(f)
        return not q.waiting

    wait_until(step, timeout, "the compiles")
    return ready, failed


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


# 1,500 optional properties: 40 KB of schema, tens of seconds of compile.
SLOW_SCHEMA = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1500)}})


@pytest.fixture(scope="module")
def queue(tokenizer: Any) -> Any:
    """One queue (and its compile processes, seconds to start) for the tests of plain use."""
    q = _queue(tokenizer, timeout=120)
    yield q
    pids = q.pool.pids()
    q.shutdown()
    assert not [p for p in pids if _alive(p)]


def test_the_queue_caches_grammars_and_failures(queue: GrammarQueue) -> None:
    q, before = queue, queue.status()
    key = ("regex", "[ab]+")
    assert q.matcher_now(key) is None
    q.add("r1", key, "item1")
    ready, _ = _settled(q)
    assert ready[0][0] == "item1"
    assert q.matcher_now(key) is not None and q.status()["grammar_cache_hits"] == before["grammar_cache_hits"] + 1
    q.add("r2", ("regex", "("), "bad")
    _, failed = _settled(q)
    assert failed[0][0] == "bad" and "regex" in failed[0][1] and failed[0][2] == 400
    q.add("r3", ("regex", "("), "bad again")  # from memory: no second compile
    assert q.poll()[1][0][:2] == ("bad again", failed[0][1])
    assert q.status()["grammar_cache_misses"] == before["grammar_cache_misses"] + 2


def test_requests_for_a_constraint_in_flight_share_its_compile(queue: GrammarQueue) -> None:
    q, before = queue, queue.status()
    for i in range(3):
        q.add(f"r{i}", ("regex", "[xy]{3}"), i)
    assert len({id(w.future) for w in q.waiting.values()}) == 1
    ready, _ = _settled(q)
    assert sorted(item for item, _ in ready) == [0, 1, 2]
    assert q.status()["grammar_cache_misses"] == before["grammar_cache_misses"] + 1


def test_a_verdict_for_a_request_that_left_is_ignored(queue: GrammarQueue) -> None:
    """Finding: under TP, rank 0 decides before the tick's aborts are applied, and a verdict
    for a request aborted in the same tick raised on every rank."""
    q = queue
    q.add("r1", ("regex", "[cd]+"), "item")
    _settled(q)
    q.add("r2", ("regex", "[cd]+"), "gone")
    verdicts = q.decide()
    assert q.abort("r2") == "gone"
    assert q.settle(verdicts) == ([], [])


def test_a_compile_past_its_deadline_is_killed_and_remembered(tokenizer: Any) -> None:
    """Finding: the compile ran on in its thread after the timeout, and the timeout dropped the
    cache entry, so resending the schema queued another compile behind it."""
    q = _queue(tokenizer, timeout=1.0)
    try:
        key = ("json_schema", SLOW_SCHEMA)
        q.add("r1", key, "slow")
        (pid,) = wait_until(q.pool.pids, 120, "the compile process to start")
        _, failed = _settled(q)
        assert "took longer than 1 s" in failed[0][1] and failed[0][2] == 400
        wait_until(lambda: (q.poll(), not q.inflight)[1], 60, "the compile to be killed")
        assert not _alive(pid) and q.pool.pids() == []  # it no longer costs CPU
        q.add("r2", key, "again")
        assert "took longer than" in q.poll()[1][0][1]  # at once, from memory
        assert q.status()["grammar_cache_misses"] == 1
        q.add("r3", ("regex", "ok"), "next")  # a fresh process takes the next compile (its start
        wait_until(lambda: (q.poll(), q.cache.get(("regex", "ok")))[1], 120, "the next compile")  # may outlast 1 s)
    finally:
        q.shutdown()


def test_pending_compiles_are_bounded_and_the_excess_is_refused_at_once(tokenizer: Any) -> None:
    q = _queue(tokenizer, timeout=60, limits=PoolLimits(workers=1, max_pending=1))
    try:
        for i in range(4):
            q.add(f"r{i}", ("regex", f"b{{{i + 1}}}"), i)
        busy = [f for f in q.poll()[1] if f[2] == 429]
        assert len(busy) >= 2 and "try again later" in busy[0][1]  # one running, one pending at most
        ready, failed = _settled(q)
        assert len(ready) + len(busy) == 4 and not failed
        q.add("again", ("regex", f"b{{{busy[0][0] + 1}}}"), "again")  # a refusal is not remembered
        assert _settled(q)[0][0][0] == "again"
    finally:
        q.shutdown()


def test_the_cache_is_bounded_by_count_and_bytes() -> None:
    cache = GrammarCache(max_entries=3, max_bytes=100)
    for i in range(3):
        cache.put(("regex", str(i)), f"g{i}", 40)
    assert list(cache.ready) == [("regex", "1"), ("regex", "2")] and cache.bytes == 80
    cache.get(("regex", "1"))
    cache.put(("regex", "3"), "g3", 10)
    cache.put(("regex", "4"), "g4", 10)
    assert list(cache.ready) == [("regex", "1"), ("regex", "3"), ("regex", "4")] and cache.bytes == 60
    for i in range(MAX_FAILURES + 5):
        cache.fail(("regex", f"bad{i}"), "no", 400, now=0.0)
    assert len(cache.failed) == MAX_FAILURES and cache.failure(("regex", "bad0"), now=0.0) is None
    assert cache.failure(("regex", f"bad{MAX_FAILURES}"), now=0.0) == ("no", 400)
    assert cache.failure(("regex", f"bad{MAX_FAILURES}"), now=FAILURE_TTL) is None


def test_a_grammar_larger_than_the_cap_is_refused(tokenizer: Any) -> None:
    """Finding: a 180 KB enum compiled to 27 MB, and the cache was bounded by count alone."""
    enum = json.dumps({"enum": [f"value-{i:06d}-abcdefgh" for i in range(400)]})
    q = _queue(tokenizer, timeout=60, limits=PoolLimits(max_bytes=16 * 2**10))
    try:
        q.add("r", ("json_schema", enum), "big")
        q.add("s", ("regex", "small"), "small")
        ready, failed = _settled(q)
        assert [item for item, _ in ready] == ["small"] and q.cache.bytes > 0
        assert failed[0][0] == "big" and "MiB a grammar may hold" in failed[0][1], failed
    finally:
        q.shutdown()


def test_shutdown_leaves_no_compile_process(tokenizer: Any) -> None:
    q = _queue(tokenizer, timeout=60, limits=PoolLimits(workers=2))
    q.add("a", ("json_schema", SLOW_SCHEMA), "a")
    q.add("b", ("json_schema", SLOW_SCHEMA.replace("p1", "q1")), "b")
    pids = wait_until(lambda: len(q.pool.pids()) == 2 and q.pool.pids(), 120, "both compile processes")
    q.shutdown()
    assert not [p for p in pids if _alive(p)]


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


# A compile process cannot take the pod's memory: its address space is capped at what it holds
# once its backend is built plus a headroom (compile_worker.py). Found: a schema of 1,000 optional
# properties drove one compile child to 5 GB before its text was refused.
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc are Linux's")
def test_bound_memory_turns_a_huge_allocation_into_a_memory_error() -> None:
    code = ("from tandem.engine.grammar.compile_worker import bound_memory\n"
            "bound_memory(256 * 2**20)\n"
            "try:\n    b = bytearray(1 << 30)\nexcept MemoryError:\n    print('refused')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "refused", out.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc are Linux's")
def test_a_schema_that_would_take_gigabytes_fails_alone_and_the_pool_goes_on(tokenizer: Any) -> None:
    huge = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}})
    q = _queue(tokenizer, timeout=120)
    try:
        q.add("huge", ("json_schema", huge), "huge")
        q.add("small", ("regex", "[ab]+"), "small")
        ready, failed = _settled(q, timeout=180)
        assert [item for item, _ in ready] == ["small"]
        assert failed and failed[0][0] == "huge" and "too large" in failed[0][1], failed
        peaks = [int(line.split()[1]) for pid in q.pool.pids()
                 for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmHWM:")]
        assert all(kb < 3 * 2**20 for kb in peaks), peaks  # under 3 GiB resident; it reached 5 without the cap
    finally:
        q.shutdown()
