"""Structured outputs and tools through the router: the fields reach the worker as the client
sent them, bad shapes are 400s before any worker, the router renders tools and tool calls into
the prompt as transformers does (the worker's ids), and cache-aware routing keys on that
prompt, never on the output constraint."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
from router_fakes import FakeWorker, fakes, router, run

from tandem.protocol.chat_api import ChatCompletionRequest
from tandem.router.config import RouterConfig
from tandem.router.routes import chat_job
from tandem.router.tokenizer import ByteTokenizer, RouterTokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
HISTORY = [{"role": "user", "content": "weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
            "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
            "{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _tool_model(model_path, tmp_path: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path("tiny") / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    return tmp_path


def _body(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny", "messages": HISTORY, "tools": [WEATHER], **kw})


def test_the_router_renders_tools_and_calls_as_the_worker(model_path, tmp_path) -> None:
    from transformers import AutoTokenizer

    from tandem.server.tokens import Tokens

    model = _tool_model(model_path, tmp_path)
    hf = AutoTokenizer.from_pretrained(str(model))
    body = _body()
    worker = Tokens(hf, {"max_context_len": 4096, "capacity_tokens": 4096, "vocab_size": len(hf)})
    ids = RouterTokenizer(str(model)).chat(body.template_messages(), body.template_tools())
    assert ids == worker.chat(body.template_messages(), body.template_tools())
    text = hf.decode(ids)
    assert text.startswith('<tools>{"type": "function", "function": {"name": "get_weather"')
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text  # an object
    assert "<tool>22C[call_1]<assistant>" in text


def test_routing_keys_on_the_prompt_not_the_constraint(model_path, tmp_path) -> None:
    for tokenizer in (RouterTokenizer(str(_tool_model(model_path, tmp_path))), ByteTokenizer()):
        def key(state: Any = SimpleNamespace(model_name="tiny", tokenizer=tokenizer), **kw: Any) -> list[int]:
            return asyncio.run(chat_job(state, _body(**kw), {})).ids

        plain = key()
        assert key(tool_choice="required") == key(tool_choice="auto") == plain
        assert key(tool_choice={"type": "function", "function": {"name": "get_weather"}}) == plain
        assert key(response_format={"type": "json_object"}, tool_choice="none") == key(tool_choice="none") != plain


BODY = {"model": "tiny", "messages": HISTORY, "tools": [WEATHER], "tool_choice": "required",
        "parallel_tool_calls": False, "max_tokens": 8}


def test_the_fields_reach_the_worker_and_bad_shapes_stop_at_the_router() -> None:
    worker = FakeWorker()

    async def test() -> None:
        async with fakes(worker) as urls, httpx.AsyncClient() as c, router(RouterConfig(
                model_name="tiny", workers=tuple(urls), policy="cache_aware", health_interval=100)) as (url, _):
            schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
            for body in (BODY, {**BODY, "tool_choice": "auto", "response_format": schema},
                         {**BODY, "tool_choice": "none", "regex": "[ab]+"}):
                r = await c.post(url + "/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                assert worker.posts[-1].json() == body
            for bad in ({**BODY, "tool_choice": {"type": "function", "function": {"name": "other"}}},
                        {**BODY, "response_format": {"type": "json_object"}},
                        {**BODY, "tools": [WEATHER, WEATHER]}):
                r = await c.post(url + "/v1/chat/completions", json=bad)
                assert r.status_code == 400 and r.json()["error"]["message"], r.text
            assert len(worker.posts) == 3
            g = {"text": "x", "sampling_params": {"max_new_tokens": 2, "structural_tag": '{"type": "x"}'}}
            assert (await c.post(url + "/generate", json=g)).status_code == 200
            assert worker.posts[-1].json() == g

    run(test)
