"""Structured outputs and tools through the worker's real HTTP layer, in process: the app of
`tandem serve` over a front that records what each request asked the scheduler for and answers
with canned text (tokenized by the tiny model's tokenizer), so no model runs.

Every bad shape of response_format, tools, tool_choice and the SGLang constraint fields is a 400
in OpenAI's error JSON; each good one becomes the constraint the engine compiles; canned answers
come back as tool calls and reasoning, and the official client's stream accumulation equals the
non-streamed response."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from jsonschema.validators import Draft202012Validator
from starlette.testclient import TestClient

from tandem.engine.engine_config import EngineConfig
from tandem.protocol import limits as L
from tandem.protocol.messages import ReqOutput
from tandem.server.app import build_app
from tandem.server.config import ServerConfig
from tandem.server.front import Stream
from tandem.server.runtime import Runtime
from tandem.server.tokens import Tokens

USER = [{"role": "user", "content": "weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"$ref": "#/$defs/Query"}}, "$defs": {"Query": {"type": "string"}}}}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
TOOL_TEMPLATE = ("{% if tools %}{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}{% endif %}"
                 "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
                 "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% endif %}"
                 "{% if m.tool_call_id %} (answers {{ m.tool_call_id }}){% endif %}\n{% endfor %}assistant:")


class CannedFront:
    """The front's request side: records (input_ids, sampling) and answers `answer` token by
    token, or refuses as the scheduler refuses a constraint it cannot compile."""

    draining = False
    error = None

    def __init__(self, tok: Any) -> None:
        self.tok, self.opened, self.answer, self.refusal = tok, [], "", None

    def open(self, ids: list[int], sampling: dict[str, Any], client_rid: str | None = None, **_: Any) -> Stream:
        self.opened.append((ids, sampling))
        s = Stream(f"r{len(self.opened)}")
        if self.refusal is not None:
            reason = {"kind": "abort", "status": 400, "message": self.refusal}
            s.queue.put_nowait(ReqOutput(s.rid, [], finished=True, finish_reason=reason))
            return s
        toks = self.tok.encode(self.answer, add_special_tokens=False)
        for i, t in enumerate(toks):
            s.queue.put_nowait(ReqOutput(s.rid, [t], completion_tokens=i + 1, prompt_tokens=len(ids)))
        s.queue.put_nowait(ReqOutput(s.rid, [], finished=True, finish_reason={"kind": "stop"},
                                     completion_tokens=len(toks), prompt_tokens=len(ids)))
        return s

    def admit(self, count: int) -> None:
        pass

    def close(self, stream: Stream) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path("tiny")))
    tok.chat_template = TOOL_TEMPLATE
    return tok


@pytest.fixture
def worker(tokenizer):
    """(TestClient, CannedFront) of a worker app that reads <think> as Qwen3 does."""
    config = ServerConfig(role="colocated", model_path="/nowhere", served_model_name="tiny", engine=EngineConfig(),
                          reasoning_parser="qwen3")
    app = build_app(config)
    front = CannedFront(tokenizer)
    info = {"max_context_len": 4096, "capacity_tokens": 4096, "vocab_size": len(tokenizer)}
    app.state.runtime = Runtime(config, front, Tokens(tokenizer, info), SimpleNamespace(), "hermes", ready=True)
    return TestClient(app), front


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, "max_tokens": 64, **kw}


def json_schema_format(schema: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, **extra}}


BAD_CHAT = {
    "unknown response_format": dict(response_format={"type": "xml"}),
    "response_format not an object": dict(response_format="json"),
    "json_schema without its name": dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
    "json_schema without a schema": dict(response_format={"type": "json_schema", "json_schema": {"name": "a"}}),
    "a schema that is not one": dict(response_format=json_schema_format({"type": "objekt"})),
    "a schema with a bad pattern": dict(response_format=json_schema_format({"type": "string", "pattern": "("})),
    "a $schema that is an object": dict(response_format=json_schema_format({"$schema": {}})),
    "a schema past the bound": dict(response_format=json_schema_format(
        {"type": "object", "description": "x" * L.MAX_CONSTRAINT_CHARS})),
    "a schema name with spaces": dict(response_format=json_schema_format(SCHEMA) | {"json_schema": {
        "name": "my answer", "schema": SCHEMA}}),
    "tools not a list": dict(tools={"type": "function"}),
    "a tool that is not a function": dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]),
    "a tool without a name": dict(tools=[{"type": "function", "function": {"parameters": {}}}]),
    "a tool name with a space": dict(tools=[{"type": "function", "function": {"name": "get weather"}}]),
    "a tool name of 65 characters": dict(tools=[{"type": "function", "function": {"name": "f" * 65}}]),
    "two tools of one name": dict(tools=[WEATHER, WEATHER]),
    "too many tools": dict(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(L.MAX_TOOLS + 1)]),
    "parameters that are not a schema": dict(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 3}}}}}]),
    "an unknown tool_choice": dict(tools=[WEATHER], tool_choice="always"),
    "tool_choice naming no tool": dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
    "tool_choice required without tools": dict(tool_choice="required"),
    "a named tool_choice without tools": dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    "tool_choice of a bad type": dict(tools=[WEATHER], tool_choice={"type": "tool", "function": {"name": "x"}}),
    "parallel_tool_calls not a bool": dict(tools=[WEATHER], parallel_tool_calls=[1]),
    "response_format and a forced tool": dict(tools=[WEATHER], tool_choice="required",
                                              response_format={"type": "json_object"}),
    "response_format and a regex": dict(response_format={"type": "json_object"}, regex="a+"),
    "a regex and an ebnf": dict(regex="a+", ebnf='root ::= "a"'),
    "an empty regex": dict(regex=""),
    "a json_schema string that is not JSON": dict(json_schema="{"),
    "a json_schema string that is not a schema": dict(json_schema='{"type": 1}'),
    "a constraint past the bound": dict(regex="a" * (L.MAX_CONSTRAINT_CHARS + 1)),
    "a tool message without tool_call_id": dict(messages=USER + [{"role": "tool", "content": "22C"}]),
    "tool_calls on a user message": dict(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
    "a tool call without its function": dict(messages=[{"role": "assistant", "tool_calls": [{"id": "c1"}]}]),
}


@pytest.mark.parametrize("extra", BAD_CHAT.values(), ids=BAD_CHAT.keys())
def test_bad_chat_shapes_are_400s_in_openai_error_json(worker, extra: dict[str, Any]) -> None:
    client, front = worker
    r = client.post("/v1/chat/completions", json=chat(**extra))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert front.opened == []


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"model": "tiny", "prompt": "x", "regex": "a", "json_schema": '{"type": "object"}'}),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "ebnf": ["root ::= x"]}),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a", "structural_tag": "{}"}}),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": '{"type": "objekt"}'}}),
    ("/generate", {"text": "x", "sampling_params": {"ebnf": ""}}),
])
def test_bad_constraints_on_completions_and_generate_are_400s(worker, path: str, body: dict[str, Any]) -> None:
    client, front = worker
    r = client.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["message"], r.text
    assert front.opened == []


def _constraint(worker, path: str, body: dict[str, Any]) -> dict[str, Any]:
    client, front = worker
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    sampling = front.opened[-1][1]
    return {k: sampling[k] for k in ("json_schema", "regex", "ebnf", "structural_tag") if k in sampling}


def test_each_request_shape_becomes_its_constraint(worker) -> None:
    post = lambda body, path="/v1/chat/completions": _constraint(worker, path, body)  # noqa: E731
    assert post(chat(response_format={"type": "json_object"})) == {"json_schema": '{"type":"object"}'}
    assert post(chat(response_format={"type": "text"})) == {}
    assert json.loads(post(chat(response_format=json_schema_format(SCHEMA, strict=True)))["json_schema"]) == SCHEMA
    named = chat(tools=[WEATHER, SEARCH], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(post(named)["json_schema"]) == WEATHER["function"]["parameters"]
    assert post(chat(tools=[WEATHER], tool_choice="auto")) == post(chat(tools=[WEATHER])) == {}
    assert post(chat(regex="(yes|no)")) == {"regex": "(yes|no)"}
    assert post({"model": "tiny", "prompt": "x", "ebnf": 'root ::= "a"'}, "/v1/completions") == {"ebnf": 'root ::= "a"'}
    tag = '{"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}'
    assert post({"text": "x", "sampling_params": {"structural_tag": tag}}, "/generate") == {"structural_tag": tag}


def test_required_is_an_array_of_the_tools_calls(worker) -> None:
    schema = json.loads(_constraint(worker, "/v1/chat/completions", chat(tools=[WEATHER, SEARCH],
                                                                         tool_choice="required"))["json_schema"])
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    items = schema["items"]["anyOf"]
    assert [i["properties"]["name"] for i in items] == [{"enum": ["get_weather"]}, {"enum": ["search"]}]
    assert items[0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert items[1]["properties"]["parameters"] == {"type": "object", "properties": {"q": {"$ref": "#/$defs/Query"}}}
    assert schema["$defs"] == {"Query": {"type": "string"}}  # moved to the root, where the $ref resolves
    one = json.loads(_constraint(worker, "/v1/chat/completions", chat(tools=[WEATHER], tool_choice="required",
                                                                      parallel_tool_calls=False))["json_schema"])
    assert one["maxItems"] == 1


def test_tools_and_calls_reach_the_chat_template(worker, tokenizer) -> None:
    client, front = worker
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]
    assert client.post("/v1/chat/completions", json=chat(messages=history, tools=[WEATHER])).status_code == 200
    prompt = tokenizer.decode(front.opened[-1][0])
    assert prompt.startswith("TOOL get_weather\n")
    assert 'assistant: CALL get_weather {"city": "Paris"}' in prompt and "tool: 22C (answers call_1)" in prompt
    client.post("/v1/chat/completions", json=chat(tools=[WEATHER], tool_choice="none"))
    assert "TOOL" not in tokenizer.decode(front.opened[-1][0])  # not offered under "none"


ANSWER = ('<think>\nParis, so get_weather.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", '
          '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"q": "x"}}'
          "\n</tool_call>")


def test_a_canned_answer_streams_into_the_same_tool_calls(worker) -> None:
    client, front = worker
    front.answer = ANSWER
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)
    kw = dict(model="tiny", messages=USER, tools=[WEATHER, SEARCH], max_tokens=64)
    whole = oai.chat.completions.create(**kw)
    with oai.chat.completions.stream(**kw) as stream:
        streamed = stream.get_final_completion()
    for r in (whole, streamed):
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert msg.content == "Checking.\n" and msg.reasoning_content == "\nParis, so get_weather.\n"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
            ("get_weather", {"city": "Paris"}), ("search", {"q": "x"})]
        assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls)


def test_a_named_function_streams_its_arguments(worker) -> None:
    client, front = worker
    front.answer = '{"city":"Paris"}'
    body = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert whole["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    chunks = _sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    calls = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city":"Paris"}'
    assert len(calls) > 2 and all("id" not in c for c in calls[1:])  # arguments stream as they come
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_constraint_the_scheduler_refuses_is_a_400_streamed_or_not(worker) -> None:
    client, front = worker
    front.refusal = "invalid regex: unbalanced parenthesis"
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json=chat(regex="(a", stream=stream))
        assert r.status_code == 400 and "unbalanced" in r.json()["error"]["message"]
    r = client.post("/generate", json={"text": "x", "stream": True, "sampling_params": {"regex": "(a"}})
    assert r.status_code == 400


def _sse(text: str) -> list[dict[str, Any]]:
    lines = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_a_schema_is_checked_off_the_event_loop_while_other_requests_answer(worker, monkeypatch) -> None:
    """The metaschema check of a schema once held the event loop for seconds (issue 38): here it is
    held on purpose until a plain request on the same worker has answered. On the loop, the plain
    request could not start and the held check would give up first."""
    client, front = worker
    entered, release = threading.Event(), threading.Event()
    real = Draft202012Validator.iter_errors

    def held(self: Any, instance: Any, *a: Any, **kw: Any) -> Any:
        if isinstance(instance, dict) and instance.get("title") == "held":
            entered.set()
            if not release.wait(10):
                raise TimeoutError("the check was never released")
        return real(self, instance, *a, **kw)

    monkeypatch.setattr(Draft202012Validator, "iter_errors", held)

    async def main() -> None:
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            schema = json_schema_format({"title": "held", "type": "object"})
            slow = asyncio.create_task(c.post("/v1/chat/completions", json=chat(response_format=schema)))
            assert await asyncio.to_thread(entered.wait, 10)
            plain = await c.post("/v1/chat/completions", json=chat())
            assert plain.status_code == 200 and not slow.done()
            release.set()
            assert (await slow).status_code == 200

    try:
        asyncio.run(main())
    finally:
        release.set()
    assert len(front.opened) == 2
