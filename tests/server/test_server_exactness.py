"""Greedy output through HTTP equals the offline Engine's, token for token, with 32
concurrent streams, through both the SGLang and the OpenAI APIs."""

from __future__ import annotations

import asyncio
import json

import httpx

from tandem import Engine

PROMPTS = [f"request {i}: " + "word " * (i % 7) for i in range(32)]
SP = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def test_32_concurrent_streams_match_the_engine(worker, model_path) -> None:
    with Engine(str(model_path("tiny")), dtype="float32", max_total_tokens=16384) as eng:
        expected = eng.generate(PROMPTS, SP)

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[list[int], str]:
        ids, text = [], ""
        async with client.stream("POST", "/generate", json={"text": prompt, "sampling_params": SP,
                                                            "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])  # incremental: each chunk holds what is new
                    ids, text = ids + chunk["output_ids"], text + chunk["text"]
        return ids, text

    async def main() -> list[tuple[list[int], str]]:
        async with httpx.AsyncClient(base_url=worker.url, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    got = asyncio.run(main())
    assert [g[0] for g in got] == [e["token_ids"] for e in expected]
    assert [g[1] for g in got] == [e["text"] for e in expected]


def test_generate_batch_and_input_ids(worker, model_path) -> None:
    with Engine(str(model_path("tiny")), dtype="float32", max_total_tokens=16384) as eng:
        expected = eng.generate([[3, 4, 5], [6, 7]], SP)
    r = worker.post("/generate", {"input_ids": [[3, 4, 5], [6, 7]], "sampling_params": SP})
    assert r.status_code == 200, r.text
    assert [x["output_ids"] for x in r.json()] == [e["token_ids"] for e in expected]
    meta = r.json()[0]["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12} and meta["prompt_tokens"] == 3


def test_generate_logprobs_and_rid(worker) -> None:
    r = worker.post("/generate", {"text": "hi", "rid": "my-request", "return_logprob": True, "top_logprobs_num": 2,
                                  "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    meta = r.json()["meta_info"]
    assert meta["id"] == "my-request" and len(meta["output_token_logprobs"]) == 3
    assert all(len(row) == 2 for row in meta["output_top_logprobs"])
    # SGLang parameters this engine does not run are refused by name, not ignored.
    bad = worker.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3, "frequency_penalty": 1}})
    assert bad.status_code == 400 and "frequency_penalty" in bad.json()["error"]["message"]


def test_dp2_worker_matches_the_engine(model_path) -> None:
    """--dp-size 2: two scheduler processes behind one front; same greedy tokens, both pools whole."""
    from worker_process import Worker

    with Engine(str(model_path("tiny")), dtype="float32", max_total_tokens=16384) as eng:
        expected = eng.generate(PROMPTS[:8], SP)
    with Worker.colocated(model_path("tiny"), "--dp-size", "2", "--max-total-tokens", "8192") as w:
        got = [w.post("/generate", {"text": p, "sampling_params": SP}).json()["output_ids"] for p in PROMPTS[:8]]
        assert got == [e["token_ids"] for e in expected]
        state = w.pool()
        assert [r["dp_rank"] for r in state["ranks"]] == [0, 1] and state["whole"], state


def test_generate_streams_only_what_is_new(worker) -> None:
    """Each /generate chunk carries the new text, ids and logprobs only (never all so far: that is
    quadratic in the answer's length); together they are the non-streamed answer."""
    body = {"text": "count with me", "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    whole = worker.post("/generate", body).json()
    chunks = []
    with httpx.stream("POST", worker.url + "/generate", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert len(chunks) > 1 and all(len(c["output_ids"]) < 24 for c in chunks)
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    lps = [x for c in chunks for x in c["meta_info"]["output_token_logprobs"]]
    assert [x[1] for x in lps] == whole["output_ids"]
    assert all(len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"]) for c in chunks)
    assert chunks[-1]["meta_info"]["completion_tokens"] == 24  # counts stay running totals
