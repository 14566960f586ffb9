"""Smoke test of bench/small_m_gemm.py (the decode matmuls alone), run as a script: tiny shapes on
CPU always, the Llama-1B shape on CUDA when there is a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "small_m_gemm.py"


@pytest.mark.parametrize("device,shape", [("cpu", "tiny"), pytest.param("cuda", "llama-1b", marks=pytest.mark.gpu)])
def test_small_m_gemm_smoke(device: str, shape: str, tmp_path: Path) -> None:
    out = tmp_path / "gemm.json"
    argv = [sys.executable, str(SCRIPT), "--device", device, "--shape", shape, "--rows", "1,2", "--iters", "3",
            "--out", str(out)]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["device"] == device and res["copy_bandwidth_GBps"] > 0
    rows = res["shapes"][shape]
    forms = {"linear", "pretransposed"} | ({"cublaslt", "fp32_reduce"} if device == "cuda" else set())
    assert {(r["linear"], r["rows"], r["form"]) for r in rows} == {
        (name, m, f) for name in {r["linear"] for r in rows} for m in (1, 2) for f in forms}
    assert all(r["us"] > 0 and r["weight_GBps"] > 0 for r in rows)
