"""The real model served, SmolLM2-135M-Instruct, held to HF transformers on every path a
request can take: `tandem serve` colocated, the real sglang-router in front of it, and
`tandem up` (our router in front of a prefill and a decode worker passing KV over NIXL).

On each path, for the fixed chat set (tests/conftest.py, CHATS): the chat answer's text,
finish reason and usage; the streamed answer chunk by chunk (Chinese, emoji and Japanese
characters span tokens: no chunk may hold U+FFFD, and the chunks join to the whole answer);
and /generate on the templated ids, whose output ids must equal HF greedy's token for token.
Every worker's KV pool is whole afterwards.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from up_stack import SMALL, Stack, _pools_whole
from worker_process import Worker, sglang_router

NAME = "smollm2"


@pytest.fixture(scope="module")
def colocated(smollm2):
    with Worker.colocated(smollm2, "--max-total-tokens", "8192", name=NAME) as w:
        yield w
        assert w.pool()["whole"], w.output()


def check_path(url: str, cases: list[dict]) -> int:
    """Every case through `url`, three ways at once (one batch); returns the token-exact count."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    with ThreadPoolExecutor(3 * len(cases)) as pool:
        jobs = [pool.submit(check, client, url, case) for case in cases for check in (_chat, _streamed, _ids)]
        return sum(job.result() for job in jobs)


def _ask(case: dict) -> dict:
    return {"model": NAME, "messages": case["messages"], "max_tokens": case["max_tokens"], "temperature": 0}


def _chat(client: openai.OpenAI, url: str, case: dict) -> int:
    reply = client.chat.completions.create(**_ask(case))
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason) == (case["text"], case["finish_reason"])
    assert reply.usage.prompt_tokens == len(case["prompt_ids"])
    assert reply.usage.completion_tokens == len(case["ids"])
    return 0


def _streamed(client: openai.OpenAI, url: str, case: dict) -> int:
    parts, reasons = [], []
    for chunk in client.chat.completions.create(**_ask(case), stream=True):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
    assert not any("\ufffd" in p for p in parts), parts
    assert "".join(parts) == case["text"] and reasons[-1] == case["finish_reason"]
    return 0


def _ids(client: openai.OpenAI, url: str, case: dict) -> int:
    got = httpx.post(url + "/generate", timeout=300, json={
        "input_ids": case["prompt_ids"], "sampling_params": {"max_new_tokens": case["max_tokens"], "temperature": 0}})
    out = got.json()
    assert out["output_ids"] == case["ids"], (case["messages"], out["text"], case["text"])
    assert out["text"] == case["text"]
    return 1


def test_serve_colocated_equals_hf(colocated: Worker, smollm2_reference: list[dict]) -> None:
    assert check_path(colocated.url, smollm2_reference) == len(smollm2_reference)
    # Special tokens stay out of the text unless asked for (vLLM's skip_special_tokens).
    first = smollm2_reference[0]
    client = openai.OpenAI(base_url=colocated.url + "/v1", api_key="none", max_retries=0, timeout=120)
    ask = {"model": NAME, "messages": first["messages"], "max_tokens": 20, "temperature": 0}
    assert client.chat.completions.create(**ask).choices[0].message.content == "The capital of France is Paris."
    kept = client.chat.completions.create(**ask, extra_body={"skip_special_tokens": False})
    assert kept.choices[0].message.content == "The capital of France is Paris.<|im_end|>"
    assert colocated.pool()["whole"]


def test_sglang_router_in_front_equals_hf(colocated: Worker, smollm2_reference: list[dict]) -> None:
    router, url = sglang_router("--worker-urls", colocated.url)
    try:
        assert check_path(url, smollm2_reference) == len(smollm2_reference)
    finally:
        router.terminate()
        router.wait(30)
    assert colocated.pool()["whole"]


def test_tandem_up_pd_equals_hf(smollm2, smollm2_reference: list[dict]) -> None:
    """The README's first command on the real model (fp32 here, to compare with HF): it comes
    up, answers its first question correctly, and every path through it is token-exact."""
    stack = Stack(smollm2, "--worker-args", f"{SMALL} --dtype float32", name=NAME)
    try:
        stack.wait_up(timeout=400)
        assert "'The capital of France is Paris.'" in stack.output()
        assert check_path(stack.url, smollm2_reference) == len(smollm2_reference)
        _pools_whole(stack)
    finally:
        assert stack.stop() == 0, stack.output()
    stack.assert_gone()
