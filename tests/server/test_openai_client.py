"""The official openai client against `tandem serve --role colocated`: every feature it
exercises, and each error class with its status. The module's worker fixture checks the
KV pool is whole at the end."""

from __future__ import annotations

import httpx
import openai
import pytest


def test_models(client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion(client) -> None:
    r = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_completion_batch_n_echo_and_token_prompt(client) -> None:
    r = client.completions.create(model="tiny", prompt=["a b c", "d e"], n=2, max_tokens=4,
                                  temperature=0, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("a b c") and r.choices[0].text == r.choices[1].text  # greedy: same
    assert r.choices[2].text.startswith("d e") and r.usage.completion_tokens == 16
    by_ids = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0)
    assert len(by_ids.choices) == 2 and by_ids.usage.prompt_tokens == 5


def test_chat_and_stream_with_usage(client) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_n2_sampled_choices_differ_and_seed_reproduces(client) -> None:
    kw = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=16, temperature=1.0,
              n=2, seed=123)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert texts[0] != texts[1]


def test_stop_strings_cut_text_streaming_and_not(client) -> None:
    base = client.completions.create(model="tiny", prompt="one two", max_tokens=24, temperature=0).choices[0].text
    stop = base[5:8]
    assert stop.strip(), base
    r = client.completions.create(model="tiny", prompt="one two", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == base[: base.find(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="one two", max_tokens=24, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_logprobs_both_apis(client) -> None:
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and all(len(t) <= 3 for t in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)
    greedy = [max(t.values()) for t in lp.top_logprobs]
    assert greedy == pytest.approx(lp.token_logprobs, abs=1e-4)  # greedy picks the top token
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)
    assert "".join(e.token for e in content) == c.choices[0].message.content


@pytest.mark.parametrize("kw, fragment", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=100_000), "maximum context length"),
    (dict(model="gpt-4"), "does not exist"),
    (dict(extra_body={"top_k": 0}), "top_k"),
    (dict(frequency_penalty=1.0), "not supported"),
])
def test_bad_requests_are_400(client, kw, fragment) -> None:
    args = {"model": "tiny", "prompt": "x", "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    assert e.value.status_code == 400 and fragment in e.value.message


def test_malformed_and_wrong_shapes_are_400(worker) -> None:
    r = httpx.post(worker.url + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = worker.post("/v1/chat/completions", {"model": "tiny", "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = worker.post("/v1/completions", {"model": "tiny", "prompt": [1, 2, 10**9]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    assert worker.get("/v1/nothing").status_code == 404


def test_unknown_request_fields_are_ignored(worker) -> None:
    r = worker.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "user": "u",
                                        "some_future_field": 1})
    assert r.status_code == 200, r.text
