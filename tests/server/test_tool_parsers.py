"""Tool-call parsers (tandem/server/tools/): each format on answers shaped as its models write
them, the forced-choice sources, the choice of format for a model, and two properties fuzzed
with hypothesis: no text makes a parser raise, and text fed in any pieces parses as the whole."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem import worker_contract as contract
from tandem.server.tools.calls import CallDelta, ToolCall, merge_calls
from tandem.server.tools.choice_calls import AutoCalls, NamedCall, RequiredCalls
from tandem.server.tools.registry import FORMATS, choose_format
from tandem.server.tools.scanner import ToolScanner, parse_text

NAMES = ("get_weather", "search")
WEATHER = ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
SEARCH = ToolCall("search", '{"q": "a \\"quoted\\" </tool_call> [x]"}')


def parse(fmt: str, text: str) -> tuple[str | None, list[ToolCall]]:
    return parse_text(FORMATS[fmt](), text, NAMES)


def hermes_block(name: str, args: str, key: str = "arguments") -> str:
    return f'<tool_call>\n{{"name": "{name}", "{key}": {args}}}\n</tool_call>'


# ---- hermes (Qwen2.5 / Qwen3 / Hermes) -----------------------------------------------------------
def test_hermes_single_parallel_and_leading_text() -> None:
    assert parse("hermes", hermes_block("get_weather", WEATHER.arguments)) == (None, [WEATHER])
    two = hermes_block("get_weather", WEATHER.arguments) + "\n" + hermes_block("search", SEARCH.arguments)
    assert parse("hermes", two) == (None, [WEATHER, SEARCH])
    lead = "I'll look that up.\n\n" + hermes_block("get_weather", WEATHER.arguments)
    assert parse("hermes", lead) == ("I'll look that up.\n\n", [WEATHER])


def test_hermes_malformed_unknown_or_unclosed_blocks_stay_content() -> None:
    for text in ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
                 hermes_block("delete_everything", "{}"),
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
                 "a plain answer mentioning <tool_call without closing"):
        assert parse("hermes", text) == (text, [])
    bad_then_good = hermes_block("nope", "{}") + hermes_block("search", SEARCH.arguments)
    assert parse("hermes", bad_then_good) == (hermes_block("nope", "{}"), [SEARCH])


def test_hermes_arguments_given_as_a_json_string() -> None:
    text = hermes_block("get_weather", json.dumps(WEATHER.arguments))
    assert parse("hermes", text) == (None, [WEATHER])


# ---- llama3_json (Llama 3.x) ----------------------------------------------------------------------
def test_llama3_json_bare_tagged_and_parallel() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    assert parse("llama3_json", one) == (None, [WEATHER])
    assert parse("llama3_json", "<|python_tag|>" + one) == (None, [WEATHER])
    two = one + '; {"name": "search", "arguments": ' + SEARCH.arguments + "}"
    assert parse("llama3_json", two) == (None, [WEATHER, SEARCH])


def test_llama3_json_only_at_the_start_and_only_calls() -> None:
    text = 'The answer is {"name": "get_weather", "parameters": {}}'
    assert parse("llama3_json", text) == (text, [])
    assert parse("llama3_json", '{"name": "Bob", "age": 3}') == ('{"name": "Bob", "age": 3}', [])
    assert parse("llama3_json", '{"name": "get_weather", "parameters": {"city": ') == (
        '{"name": "get_weather", "parameters": {"city": ', [])


# ---- mistral ----------------------------------------------------------------------------------------
def test_mistral_marker_bare_array_and_leading_text() -> None:
    arr = '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, ' \
          '{"name": "search", "arguments": ' + SEARCH.arguments + "}]"
    assert parse("mistral", "[TOOL_CALLS]" + arr) == (None, [WEATHER, SEARCH])
    assert parse("mistral", arr) == (None, [WEATHER, SEARCH])
    assert parse("mistral", "Sure. [TOOL_CALLS] " + arr) == ("Sure. ", [WEATHER, SEARCH])


def test_mistral_non_calls_stay_content() -> None:
    for text in ("[1, 2, 3] are the numbers", '[TOOL_CALLS][{"name": "get_weather", "arguments": {]',
                 '[{"name": "get_weather", "arguments": {}}, {"name": "other", "arguments": {}}]', "[]"):
        assert parse("mistral", text) == (text, [])


def test_plain_text_is_content_for_every_format() -> None:
    for fmt in FORMATS:
        assert parse(fmt, "Paris is sunny today.") == ("Paris is sunny today.", [])
        assert parse(fmt, "") == ("", [])
        assert parse(fmt, "  \n") == ("  \n", [])


# ---- forced choices -----------------------------------------------------------------------------------
def test_required_reads_the_constrained_array_and_named_streams_arguments() -> None:
    src = RequiredCalls(NAMES)
    text = '[{"name":"get_weather","parameters":{"city":"Paris","unit":"celsius"}},{"name":"search","parameters":{}}]'
    assert src.feed(text) == []
    calls = merge_calls([p for p in src.finish() if isinstance(p, CallDelta)])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("search", {})]
    cut = RequiredCalls(NAMES)
    cut.feed('[{"name":"get_weather","para')
    assert cut.finish() == ['[{"name":"get_weather","para']  # cut short by max_tokens: content
    named = NamedCall("get_weather")
    pieces = named.feed('{"city":') + named.feed("") + named.feed('"Paris"}') + named.finish()
    assert pieces[0].id and pieces[0].name == "get_weather"
    assert merge_calls(pieces)[0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert merge_calls(NamedCall("search").finish())[0]["function"]["arguments"] == ""


def test_call_deltas_in_openai_shape() -> None:
    first, more = CallDelta(0, "{", id="call_1", name="f"), CallDelta(0, "}")
    assert first.to_openai() == {"index": 0, "id": "call_1", "type": "function",
                                 "function": {"name": "f", "arguments": "{"}}
    assert more.to_openai() == {"index": 0, "function": {"arguments": "}"}}


# ---- which format ---------------------------------------------------------------------------------------
def test_the_format_comes_from_the_flag_the_template_or_hermes() -> None:
    assert set(FORMATS) == set(contract.TOOL_CALL_PARSERS)
    assert choose_format("mistral", "{{ '<tool_call>' }}") == "mistral"
    assert choose_format(None, "{%- for t in tools %}<tool_call>{{ t | tojson }}</tool_call>") == "hermes"
    assert choose_format(None, "{{- '[TOOL_CALLS]' + tool_calls | tojson }}") == "mistral"
    assert choose_format(None, "{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert choose_format(None, "{{ messages }}") == choose_format(None, None) == "hermes"
    with pytest.raises(ValueError, match="unknown"):
        choose_format("xml", None)


# ---- properties ---------------------------------------------------------------------------------------------
FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_call>\n", "\n</tool_call>", "[TOOL_CALLS]", "<|python_tag|>",
             "{", "}", "[", "]", ";", '"', "\\", ",", ":", " ", "\n", "<", "</", "<tool", "[TOOL", "hello",
             '{"name": "get_weather", "arguments": {"city": "Paris"}}',
             '{"name": "search", "parameters": {"q": "x}"}}', '"name"', '"get_weather"', '"arguments"',
             '[{"name": "search", "arguments": {}}]', '{"name": "nope", "arguments": {}}']
TEXTS = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=8)), max_size=14).map("".join)


def _chunked(fmt: str, text: str, cuts: list[int]) -> tuple[str | None, list[ToolCall]]:
    scanner = ToolScanner(FORMATS[fmt](), NAMES)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [p for a, b in zip(bounds, bounds[1:]) for p in scanner.feed(text[a:b])] + scanner.finish()
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    content = "".join(p for p in pieces if isinstance(p, str))
    return (content or None) if calls else content, calls


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(sorted(FORMATS)), text=TEXTS, cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_pieces_parse_as_the_whole_and_nothing_raises(fmt: str, text: str, cuts: list[int]) -> None:
    whole = parse(fmt, text)
    assert _chunked(fmt, text, cuts) == whole
    assert _chunked(fmt, text, list(range(len(text)))) == whole  # one character at a time
    content, calls = whole
    if not calls:
        assert content == text  # nothing is lost: an answer without calls is its text


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200), fmt=st.sampled_from(sorted(FORMATS)))
def test_arbitrary_text_never_raises(text: str, fmt: str) -> None:
    for source in (AutoCalls(FORMATS[fmt](), NAMES), RequiredCalls(NAMES), NamedCall("search")):
        source.feed(text)
        source.finish()
