"""`tandem serve --tp-size 2`: two scheduler processes behind one front, answering with the
offline TP=1 Engine's tokens through the SGLang and OpenAI APIs; every rank's pool whole after."""

from __future__ import annotations

import pytest
from worker_process import Worker

from tandem import Engine

SP = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
PROMPTS = ["tensor parallel one", "tensor parallel two, longer " * 3]


def test_tp2_server_answers_like_one_rank(model_path) -> None:
    openai = pytest.importorskip("openai")
    with Engine(str(model_path("tiny")), dtype="float32", max_total_tokens=4096) as eng:
        want = [o["token_ids"] for o in eng.generate(PROMPTS, SP)]
    with Worker.colocated(model_path("tiny"), "--tp-size", "2", "--debug-tp-digest", "--max-total-tokens", "4096") as w:
        r = w.post("/generate", {"text": PROMPTS, "sampling_params": SP})
        assert r.status_code == 200, r.text
        assert [x["output_ids"] for x in r.json()] == want
        client = openai.OpenAI(base_url=w.url + "/v1", api_key="none", max_retries=0, timeout=120)
        out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 10
        assert w.get("/get_server_info").json()["tp_size"] == 2
        pool = w.pool()
        assert pool["whole"], w.output()
        ranks = pool["ranks"][0]["tp_ranks"]
        assert len(ranks) == 2 and all(p["free_tokens"] + p["cached_tokens"] == p["capacity_tokens"] for p in ranks)
