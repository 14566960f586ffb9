"""PD with an FP8 KV cache: prefill writes its fp8 pages straight into decode's fp8 pool, so the
answer is the colocated fp8 Engine's, token for token. A decode whose pool stores another dtype
is refused at the handshake, naming it, never fed bytes it would misread; so is one whose pool
stores fp8 under other scales. Pools whole after."""

from __future__ import annotations

import pytest
from model_variants import with_kv_scales
from pd_client import pd_body, pd_generate
from waits import wait_until
from worker_process import Worker, running

from tandem import Engine

pytest.importorskip("tandem.pd.transfer.nixl_agent").nixl_api()

SP = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
FLAGS = ("--page-size", "16", "--chunked-prefill-size", "64", "--max-total-tokens", "4096")
FP8 = ("--kv-cache-dtype", "fp8_e4m3")
PROMPTS = ["the quick brown fox jumps " * 30, "sixteen tokens of text " * 4]


def test_fp8_pages_cross_and_a_bf16_pool_is_refused(model_path, tmp_path) -> None:
    model = model_path("tiny")
    with Engine(str(model), dtype="float32", kv_cache_dtype="fp8_e4m3", page_size=16, chunked_prefill_size=64,
                max_total_tokens=4096) as eng:
        # One at a time, as pd_generate sends them: the fp8 path's attention pads a decode batch
        # to its longest request, so a batch of two rounds apart from one alone.
        want = [eng.generate([p], SP)[0]["token_ids"] for p in PROMPTS]
    pre = Worker.prefill(model, *FLAGS, *FP8)
    dec = Worker.decode(model, *FLAGS, *FP8, "--pd-local-prefill-threshold", "0", peers=[pre])
    with running(pre, dec):
        assert [pd_generate(pre, dec, {"text": p, "sampling_params": SP})["output_ids"] for p in PROMPTS] == want
        # Both refused decodes start at once: each one's handshake is independent of the other.
        plain = Worker.decode(model, *FLAGS, peers=[pre])
        scaled = Worker.decode(with_kv_scales(model, tmp_path / "scaled", k=2.0, v=0.5), *FLAGS, *FP8, peers=[pre])
        try:
            wait_until(lambda: "handshake refused: mismatch in dtype" in plain.output(), 120,
                       "the plain decode's refused handshake", interval=0.2)
            plain.wait_listening()
            # To decode alone: the prefill half would wait out its 30 s bootstrap timeout.
            d = plain.post("/generate", pd_body(pre, {"text": PROMPTS[1], "sampling_params": SP}))
            assert d.status_code == 503 and "dtype" in d.json()["error"]["message"], d.text
            assert plain.pool()["whole"], plain.output()
            wait_until(lambda: "handshake refused: mismatch in model_id, kv_scales" in scaled.output(), 120,
                       "the other-scales decode's refused handshake", interval=0.2)
        finally:
            plain.stop()
            scaled.stop()
        for w in (pre, dec):
            assert w.pool()["whole"], w.output()
