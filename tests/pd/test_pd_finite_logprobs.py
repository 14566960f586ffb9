"""Logprobs under a grammar through prefill + decode. The first token's top logprobs travel in
the first-token slot; a regex that allows one token left the other four at -inf, which decode
refused as a bad slot: a 503 that the router retried and counted against the worker. They are
the floor now (tandem/protocol/logprobs.py), on both sides, and the answer is finite JSON."""

from __future__ import annotations

import json
import math

import pytest
from pd_client import pd_post, pd_stats
from worker_process import Worker, running

from tandem.protocol.logprobs import LOGPROB_FLOOR

pytest.importorskip("tandem.pd.transfer.nixl_agent").nixl_api()

FLAGS = ("--max-total-tokens", "4096")
# At most three tokens can start "yes" (y, ye, yes): two of the first token's top 5 are ruled out.
REGEX = "yes"
BODY = {"text": "yes or no?", "return_logprob": True, "top_logprobs_num": 5,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "regex": REGEX}}


@pytest.fixture(scope="module")
def stack(model_path):
    model = model_path("tiny")
    pre = Worker.prefill(model, *FLAGS)
    dec = Worker.decode(model, *FLAGS, "--pd-local-prefill-threshold", "0", peers=[pre])
    with running(pre, dec):
        yield pre, dec
        for w in (pre, dec):
            assert w.pool()["whole"], w.output()


def _strict(text: str) -> dict:
    def refuse(name: str) -> object:
        raise ValueError(f"{name} is not JSON: {text[:300]}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("path,body", [
    ("/generate", BODY),
    ("/v1/completions", {"model": "tiny", "prompt": "yes or no?", "max_tokens": 8, "temperature": 0,
                         "logprobs": 5, "regex": REGEX}),
], ids=["generate", "completions"])
def test_first_token_logprobs_under_a_grammar_reach_decode(stack, path: str, body: dict) -> None:
    pre, dec = stack
    before = pd_stats(dec)[0]["transferred"]
    p, d = pd_post(pre, dec, path, body)
    assert p.status_code == 200, p.text
    assert d.status_code == 200, d.text
    out = _strict(d.text)
    if path == "/generate":
        first_top = [lp for lp, _, _ in out["meta_info"]["output_top_logprobs"][0]]
        lps = first_top + [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    else:
        first_top = list(out["choices"][0]["logprobs"]["top_logprobs"][0].values())
        lps = first_top + out["choices"][0]["logprobs"]["token_logprobs"]
    assert all(math.isfinite(x) and LOGPROB_FLOOR <= x <= 0 for x in lps), lps
    assert LOGPROB_FLOOR in first_top
    assert pd_stats(dec)[0]["transferred"] == before + 1  # through the slot, not prefilled on decode
