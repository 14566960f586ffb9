"""PD with a mixture-of-experts model (engine/models/moe.py): a TP=2 prefill, where each rank
holds half of every expert, feeds a TP=2 decode with expert parallelism, where each rank holds
half of the experts whole (engine/parallel/experts.py). The KV layout does not depend on how
the experts are placed, so the answer is the offline TP=1 Engine's, token for token, and both
sides' pools are whole after."""

from __future__ import annotations

import pytest
from pd_client import pd_generate
from worker_process import Worker, running

from tandem import Engine

pytest.importorskip("tandem.pd.transfer.nixl_agent").nixl_api()

SP = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
FLAGS = ("--page-size", "16", "--max-total-tokens", "4096")
PROMPTS = ["the quick brown fox jumps " * 20, "sixteen tokens of text " * 4]


def test_tp2_prefill_feeds_ep2_decode_token_identical(model_path) -> None:
    model = model_path("tiny-qwen3-moe")
    with Engine(str(model), dtype="float32", page_size=16, max_total_tokens=4096) as eng:
        want = [r["token_ids"] for r in eng.generate(PROMPTS, SP)]
    pre = Worker.prefill(model, *FLAGS, "--tp-size", "2", "--debug-tp-digest")
    dec = Worker.decode(model, *FLAGS, "--tp-size", "2", "--ep-size", "2", "--debug-tp-digest",
                        "--pd-local-prefill-threshold", "0", peers=[pre])
    with running(pre, dec):
        got = [pd_generate(pre, dec, {"text": p, "sampling_params": SP})["output_ids"] for p in PROMPTS]
        assert got == want
        for w in (pre, dec):
            assert w.pool()["whole"], w.output()
