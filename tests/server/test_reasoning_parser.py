"""--reasoning-parser (tandem/server/reasoning.py) and the assistant message it feeds
(assistant_output.py): <think>...</think> split off whole and streamed, in any pieces."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem import worker_contract as contract
from tandem.protocol.chat_api import ChatCompletionRequest
from tandem.server.assistant_output import ChatDelta, assistant_parser
from tandem.server.reasoning import REASONING_PARSERS, ReasoningSplitter


def split(name: str, text: str) -> tuple[str, str]:
    return ReasoningSplitter(REASONING_PARSERS[name]).feed(text, final=True)


def test_the_contract_names_every_reasoning_parser() -> None:
    assert set(REASONING_PARSERS) == set(contract.REASONING_PARSERS)


def test_qwen3_splits_only_an_answer_that_opens_thinking() -> None:
    assert split("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!") == ("\nThe user greets me.\n", "Hello!")
    assert split("qwen3", "Hello! No thinking here.") == ("", "Hello! No thinking here.")
    assert split("qwen3", "<think>\ncut off by max_tokens") == ("\ncut off by max_tokens", "")
    assert split("qwen3", "<think></think>Hi") == ("", "Hi")


def test_deepseek_r1_reasons_from_the_start() -> None:
    assert split("deepseek-r1", "Let me think.\n</think>\n\n42") == ("Let me think.\n", "42")
    assert split("deepseek-r1", "<think>Let me think.</think>42") == ("Let me think.", "42")
    assert split("deepseek-r1", "never closed") == ("never closed", "")


TEXTS = st.lists(st.one_of(st.sampled_from(["<think>", "</think>", "<", "</", "<th", "</thi", "\n", " ", "x",
                                            "answer", "<tool_call>"]), st.text(max_size=5)),
                 max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(REASONING_PARSERS)), text=TEXTS, cuts=st.lists(st.integers(0, 200), max_size=10))
def test_any_pieces_split_as_the_whole(name: str, text: str, cuts: list[int]) -> None:
    splitter = ReasoningSplitter(REASONING_PARSERS[name])
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    parts = [splitter.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [splitter.feed("", final=True)]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == split(name, text)


def _chat(**kw: object) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": tools, **kw})


def _streamed(parser, text: str, cuts: list[int]) -> ChatDelta:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    deltas = [parser.feed(text[a:b], False) for a, b in zip(bounds, bounds[1:])] + [parser.feed("", True)]
    return ChatDelta("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas),
                     [c for d in deltas for c in d.calls])


@settings(max_examples=200, deadline=None)
@given(text=TEXTS.map(lambda t: t + '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'),
       cuts=st.lists(st.integers(0, 300), max_size=10))
def test_reasoning_then_tool_calls_stream_as_the_whole(text: str, cuts: list[int]) -> None:
    body = _chat()
    whole = assistant_parser(body, "hermes", "qwen3")
    message = whole.message(whole.feed(text, True))
    parser = assistant_parser(body, "hermes", "qwen3")
    streamed = parser.message(_streamed(parser, text, cuts))
    strip_ids = lambda m: {**m, "tool_calls": [{**c, "id": None} for c in m.get("tool_calls", [])]}  # noqa: E731
    assert strip_ids(streamed) == strip_ids(message)
    assert parser.finish_reason("stop") == ("tool_calls" if message.get("tool_calls") else "stop")


def test_the_message_shapes() -> None:
    p = assistant_parser(_chat(), "hermes", "qwen3")
    msg = p.message(p.feed('<think>hmm</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}'
                           "\n</tool_call>", True))
    assert msg["reasoning_content"] == "hmm" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "X"}'}
    assert msg["tool_calls"][0]["id"].startswith("call_") and p.finish_reason("stop") == "tool_calls"
    assert p.finish_reason("length") == "length"
    plain = assistant_parser(_chat(tool_choice="none"), "hermes", None)
    assert plain.plain and plain.message(plain.feed("", True)) == {"role": "assistant", "content": ""}
    # A constrained answer is not split for reasoning: the constraint shaped it from its first token.
    forced = assistant_parser(_chat(response_format={"type": "json_object"}, tool_choice="none"), "hermes",
                              "deepseek-r1")
    assert forced.message(forced.feed('{"a": 1}', True)) == {"role": "assistant", "content": '{"a": 1}'}
