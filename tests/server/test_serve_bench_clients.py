"""bench/serve.py's two HTTP clients against one live worker: the same requests give the same
token counts through both, and each run records the client's own CPU, the server's (its
process group, from /proc), SSE events and tokens per chunk."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def serve_bench():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH / "serve.py")
    mod = sys.modules["bench_serve"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("client", ["threads", "httpx"])
def test_client_records_cpu_and_chunks(worker, serve_bench, client):
    from workloads import Request

    reqs = [Request([20 + i, 30, 40, 50], 6 + i) for i in range(4)]
    res = serve_bench.run_http(worker.url, "tiny", reqs, concurrency=2, client=client,
                               server_pgid=os.getpgid(worker.proc.pid))
    assert res["client"] == client and res["output_tokens"] == sum(r.max_new_tokens for r in reqs)
    assert res["ttft_p50"] > 0 and res["output_tok_per_s"] > 0
    assert res["sse_events"] >= len(reqs) * 2  # a text chunk at least, and the usage chunk
    assert 1.0 <= res["tokens_per_chunk"] <= max(r.max_new_tokens for r in reqs)
    assert 0 < res["client_cpu_s"] and 0 < res["client_cpu_share"] < 1
    assert res["server_cpu_s"] > 0 and res["server_lead_cpu_s"] > 0  # the front did work too
