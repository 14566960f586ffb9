"""Smoke test of bench/gpu_decode.py: the tiny model, tiny shapes, run as a script (as a user
would, from outside the repo root), on CPU always and on CUDA when there is a GPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_decode.py"
# A step time is a difference of two timed calls: on tiny shapes and a busy machine it may come
# out at or below zero, so the smoke test asks only that the timings are numbers.
ROW_TIMINGS = ("engine_step_ms", "hf_step_ms", "engine_tok_s", "hf_tok_s", "engine_over_hf", "engine_pct_roofline",
               "hf_pct_roofline")
ROW_SIZES = ("bytes_per_step", "kv_bytes_per_step", "roofline_step_ms")
PREFILL_NUMBERS = ("engine_ms", "hf_ms", "hf_over_engine", "engine_tok_s", "hf_tok_s")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gpu_decode_smoke(device: str, tmp_path: Path, model_path) -> None:
    model_path("tiny")  # built once per session, outside the subprocess's time limit
    out = tmp_path / "gpu_decode.json"
    argv = [sys.executable, str(SCRIPT), "--model", "tiny", "--device", device, "--batches", "1,2",
            "--context", "16", "--steps", "4", "--prefill", "2x32", "--repeats", "1", "--out", str(out)]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eng %roof" in proc.stdout  # the table

    res = json.loads(out.read_text())
    assert res["device"] == device and res["torch"] and res["device_name"]
    assert res["copy_bandwidth_GBps"] > 0 and res["weight_bytes"] > 0 and res["kv_bytes_per_token"] > 0
    assert "read + write" in res["copy_bandwidth_convention"]
    assert [r["batch"] for r in res["decode"]] == [1, 2]
    for row in res["decode"]:
        assert (row["context"], row["steps"]) == (16, 4)
        for key in ROW_SIZES:
            assert row[key] > 0, (key, row)
        for key in ROW_TIMINGS:
            assert math.isfinite(row[key]), (key, row)
        assert row["engine_prompt_cached_frac"] > 0.5  # decode ran on prefix-cached prompts
    assert res["prefill"]["prefill"] == "2x32"
    for key in PREFILL_NUMBERS:
        assert res["prefill"][key] > 0, key


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_prefill_profile_smoke(device: str, tmp_path: Path, model_path) -> None:
    """bench/prefill_profile.py: both sides profiled, their kernels grouped by kind."""
    model_path("tiny")
    out = tmp_path / "prefill_profile.json"
    argv = [sys.executable, str(SCRIPT.with_name("prefill_profile.py")), "--model", "tiny", "--device", device,
            "--prefill", "2x32", "--top", "5", "--out", str(out)]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for side in ("engine", "hf"):
        assert res[side]["wall_ms"] > 0 and res[side]["kernel_ms"] > 0, res[side]
        assert res[side]["kinds"]["matmul"] > 0 and 0 < len(res[side]["top"]) <= 5
    assert res["hf_over_engine_wall"] > 0
