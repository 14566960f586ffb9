"""Structured output in the engine: every constrained answer satisfies its constraint, even on
a random-weight model, and the tokens are the same in every scheduling mode (the overlap
loop samples batch N only after N-1's tokens advanced the matchers: engine/grammar/).

The schemas are generated (tests/support/json_schemas.py): objects, arrays, enums, bounded
strings and integers, nested, each closing within the token budget.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from json_schemas import TOKEN_BUDGET, TOP, assert_valid
from smoke import sized

MAX_NEW = TOKEN_BUDGET
BASE = dict(max_total_tokens=4096, max_running_requests=16)
SCENARIOS = {
    "normal": dict(disable_overlap_schedule=True),
    "overlap": dict(disable_overlap_schedule=False),
    "chunked-overlap": dict(disable_overlap_schedule=False, chunked_prefill_size=16, page_size=4),
    "mixed-chunk": dict(disable_overlap_schedule=True, chunked_prefill_size=16, enable_mixed_chunk=True),
    # An optimistic new_token_ratio admits more than fits, so decode must retract: a retracted
    # request keeps its matcher, which has accepted exactly the tokens it keeps.
    "retract": dict(disable_overlap_schedule=False, max_total_tokens=448, page_size=4,
                    init_new_token_ratio=0.02, min_new_token_ratio_factor=1.0),
}
EXTRA = {"dp2": dict(disable_overlap_schedule=False, dp_size=2, load_balance_method="round_robin")}


def _generate(eng: Any, prompts: list[str], params: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return eng.generate(prompts, params)


def _check(outs: list[dict[str, Any]], schemas: list[dict[str, Any]]) -> None:
    for out, schema in zip(outs, schemas):
        assert out["finish_reason"] == "stop", (out, schema)
        assert_valid(out["text"], schema)


@pytest.fixture(scope="module")
def engines(model_path: Any) -> Any:
    """One engine per scenario, shared by the module's examples (each start costs seconds)."""
    from engine_checks import assert_whole

    from tandem import Engine

    built: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in built:
            built[name] = Engine(str(model_path("tiny")), dtype="float32", **{**BASE, **{**SCENARIOS, **EXTRA}[name]})
        return built[name]

    yield get
    try:
        for eng in built.values():
            assert_whole(eng)
    finally:
        for eng in built.values():
            eng.shutdown()


def test_the_schema_bound_is_the_longest_answers_length() -> None:
    """worst_tokens (which keeps the generated schemas within the token budget) is the length of
    the longest compact answer: every string character escaped, optional properties present,
    arrays full, integers at their widest bound."""
    from json_schemas import worst_tokens

    schema = {"type": "object", "properties": {
        "ab": {"type": "string", "maxLength": 2},
        "n": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 10}, "maxItems": 2},
        "e": {"enum": ["x", 123]}, "f": {"type": "boolean"}}, "required": []}
    longest = {"ab": "\u0000\u0000", "n": [-5, -5], "e": 123, "f": False}
    assert worst_tokens(schema) == len(json.dumps(longest)) == len(json.dumps(longest, separators=(", ", ": ")))
    assert_valid(json.dumps(longest), schema)


# No shrinking: each example runs five engines, and a failure prints its schemas whole.
@pytest.mark.slow
@settings(max_examples=sized(3, 12), deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schemas=st.lists(TOP, min_size=1, max_size=5), temperature=st.sampled_from([0.0, 0.8]))
def test_generated_schemas_always_validate_and_match_across_modes(engines: Any, schemas: list[dict[str, Any]],
                                                                   temperature: float) -> None:
    """A batch of different schemas plus one unconstrained row, in every scheduling mode:
    every constrained answer validates, and each mode's tokens equal the normal loop's."""
    prompts = [f"describe item {i}" for i in range(len(schemas))] + ["free text"]
    params = [{"max_new_tokens": MAX_NEW, "temperature": temperature, "seed": 7 + i, "json_schema": json.dumps(s)}
              for i, s in enumerate(schemas)] + [{"max_new_tokens": 16, "temperature": temperature, "seed": 3}]
    reference = _generate(engines("normal"), prompts, params)
    _check(reference, schemas)
    for name in SCENARIOS:
        if name != "normal":
            outs = _generate(engines(name), prompts, params)
            assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in reference], name


# Data parallel: each request goes to one of two scheduler processes, which compiles its own
# grammar; a request's tokens depend on its seed, never on its rank or its batch.
@pytest.mark.slow
@settings(max_examples=sized(1, 4), deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schemas=st.lists(TOP, min_size=2, max_size=4))
def test_data_parallel_ranks_give_the_single_scheduler_tokens(engines: Any, schemas: list[dict[str, Any]]) -> None:
    prompts = [f"rank test {i}" for i in range(len(schemas))]
    params = [{"max_new_tokens": MAX_NEW, "temperature": 0.8, "seed": 11 + i, "json_schema": json.dumps(s)}
              for i, s in enumerate(schemas)]
    reference = _generate(engines("normal"), prompts, params)
    outs = _generate(engines("dp2"), prompts, params)
    _check(outs, schemas)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in reference]


@pytest.mark.parametrize("mode", ["normal", "overlap"])
def test_regex_and_ebnf_outputs_match_their_grammar(engines: Any, mode: str) -> None:
    regex = r"(yes|no|maybe), [0-9]{2,4}( \(sure\))?"
    ebnf = 'root ::= "[" item ("," item)* "]"\nitem ::= [a-c] | [0-9] [0-9]'
    outs = _generate(engines(mode), ["a", "b", "c"], [
        {"max_new_tokens": 40, "temperature": 1.0, "seed": 1, "regex": regex},
        {"max_new_tokens": 40, "temperature": 0.0, "regex": regex},
        {"max_new_tokens": 60, "temperature": 1.0, "seed": 2, "ebnf": ebnf}])
    assert re.fullmatch(regex, outs[0]["text"]) and re.fullmatch(regex, outs[1]["text"]), outs
    assert outs[2]["finish_reason"] in ("stop", "length")
    if outs[2]["finish_reason"] == "stop":
        assert re.fullmatch(r"\[([a-c]|[0-9]{2})(,([a-c]|[0-9]{2}))*\]", outs[2]["text"]), outs[2]


def test_a_bad_constraint_fails_its_request_alone_and_is_cached(engines: Any) -> None:
    eng = engines("normal")
    bad = {"max_new_tokens": 8, "json_schema": '{"type": "object", "properties": {"a": {"type": "nope"}}}'}
    outs = _generate(eng, ["x", "y", "z"], [bad, {"max_new_tokens": 8}, {"max_new_tokens": 8, "regex": "[0-9]("}])
    assert outs[0]["finish_reason"] == "abort" and "json_schema" in outs[0]["meta"]["finish_message"], outs[0]
    assert outs[1]["finish_reason"] in ("stop", "length")
    assert outs[2]["finish_reason"] == "abort" and "regex" in outs[2]["meta"]["finish_message"], outs[2]
    before = eng.status()[0].info["grammar"]
    _generate(eng, ["x"], [bad])
    after = eng.status()[0].info["grammar"]
    assert after["grammar_cache_hits"] == before["grammar_cache_hits"] + 1, (before, after)


def test_not_json_is_refused_with_a_clear_message(engines: Any) -> None:
    out = _generate(engines("normal"), ["x"], [{"max_new_tokens": 8, "json_schema": "{not json"}])[0]
    assert out["finish_reason"] == "abort" and "invalid json_schema" in out["meta"]["finish_message"], out


def test_only_one_constraint_per_request(engines: Any) -> None:
    out = _generate(engines("normal"), ["x"], [{"max_new_tokens": 8, "regex": "a", "ebnf": 'root ::= "a"'}])[0]
    assert out["finish_reason"] == "abort" and "at most one of" in out["meta"]["finish_message"], out
