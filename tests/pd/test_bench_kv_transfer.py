"""Smoke test of bench/kv_transfer.py, run as a user would (a script, outside the repo root):
whole pages, and head slices into a receiver holding half the KV heads, sent where they lie
or staged into whole pages first, and half the heads staged into a receiver holding all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from smoke import full_only

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kv_transfer.py"


_SLICES = full_only("staged-into-wider")


@pytest.mark.parametrize("extra", [[], pytest.param(["--decode-heads", "0:2"], marks=_SLICES),
                                   pytest.param(["--decode-heads", "0:2", "--staged"], marks=_SLICES),
                                   ["--prefill-heads", "2:4", "--staged"]],
                         ids=["whole-pages", "head-slices", "staged-slices", "staged-into-wider"])
def test_kv_transfer_bench_smoke(extra: list[str], tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    argv = [sys.executable, str(SCRIPT), "--tokens", "64", "--rounds", "1", "--sends", "2", "--out", str(out), *extra]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["tokens"] == 64 and len(res["rounds"]) == 1 and res["median_ratio"] > 0
    assert res["decode_heads"] == ([0, 2] if "--decode-heads" in extra else None)
    assert res["prefill_heads"] == ([2, 4] if "--prefill-heads" in extra else None)
    full = 64 * 12 * 2 * 4 * 64 * 2  # tokens x layers x K/V x KV heads x head_dim x bf16 bytes
    assert res["bytes_per_send"] == (full // 2 if extra else full)
    assert res["staged"] == ("--staged" in extra)
    env = res["meta"]["environment"]  # what ran (bench/run_meta.py)
    assert env["device"] == "cpu" and env["versions"]["nixl"] and env["source_digest"]
    assert res["meta"]["layout"]["num_layers"] == 12
