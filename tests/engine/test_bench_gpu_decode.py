"""Smoke test of bench/gpu_decode.py: the tiny model, tiny shapes, run as a script (as a user
would, from outside the repo root), on CPU always and on CUDA when there is a GPU."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_decode.py"
# A step time is a difference of two timed calls: on tiny shapes and a busy machine it may come
# out at or below zero, so the smoke test asks only that the timings are numbers.
PEERS = ("engine", "hf", "hf_static")
ROW_TIMINGS = tuple(f"{peer}_{key}" for peer in PEERS
                    for key in ("step_ms", "step_ms_min", "step_ms_max", "tok_s", "pct_roofline")) + (
    "engine_over_hf", "engine_over_hf_static")
ROW_SIZES = ("bytes_per_step", "kv_bytes_per_step", "roofline_step_ms")
PREFILL_NUMBERS = ("engine_ms", "hf_ms", "hf_over_engine", "engine_tok_s", "hf_tok_s")


def bench_module(name: str) -> ModuleType:
    """A module of bench/ (scripts, not a package), loaded by path."""
    spec = importlib.util.spec_from_file_location(name, SCRIPT.with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_meta(meta: dict, device: str, engine: bool = True) -> None:
    """What every bench result records (bench/run_meta.py)."""
    env = meta["environment"]
    assert env["device"] == device and env["device_name"] and env["source_digest"]
    assert env["versions"]["torch"] and env["versions"]["transformers"] and "flashinfer" in env["versions"]
    if not engine:
        return
    eng = meta["engine"]
    ops = eng["layer_ops"]
    assert ops["requested"] == "auto" and ops["chosen"] and ops["fell_back"] is (ops["planned"] != ops["chosen"])
    assert eng["attention_backend"] and eng["page_size"] >= 1 and eng["dtype"] and eng["engine_config"]["model"]
    assert "decode_kernel" in eng and "ragged_prefill" in eng


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gpu_decode_smoke(device: str, tmp_path: Path, model_path) -> None:
    model_path("tiny")  # built once per session, outside the subprocess's time limit
    out = tmp_path / "gpu_decode.json"
    # The static-cache peer uncompiled: a compile takes a minute or more, on CPU and within the GPU tests'
    # time limit in a session too; the benchmark's own run on the GPU (phase 3) compiles it and records so.
    static = "eager"
    argv = [sys.executable, str(SCRIPT), "--model", "tiny", "--device", device, "--batches", "1,2",
            "--context", "16", "--steps", "4", "--prefill", "2x32", "--repeats", "3", "--hf-static", static,
            "--out", str(out)]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "%roof" in proc.stdout and "%spec" in proc.stdout  # the table

    res = json.loads(out.read_text())
    assert res["device"] == device and res["torch"] and res["device_name"]
    assert res["copy_bandwidth_GBps"] > 0 and res["weight_bytes"] > 0 and res["kv_bytes_per_token"] > 0
    assert "read + write" in res["copy_bandwidth_convention"]
    assert res["hf_peers"] == ["hf", "hf_static"] and res["repeats"] == 3 and res["complete"] is True
    check_meta(res["meta"], device)
    assert res["meta"]["hf_peers"]["hf_static"]["cache"] == "static"
    assert res["layer_ops"] == res["meta"]["engine"]["layer_ops"]["chosen"]
    if device == "cpu":
        assert res["spec_bandwidth_GBps"] is None
    assert [r["batch"] for r in res["decode"]] == [1, 2]
    for row in res["decode"]:
        assert (row["context"], row["steps"]) == (16, 4)
        for key in ROW_SIZES:
            assert row[key] > 0, (key, row)
        for key in ROW_TIMINGS:
            assert math.isfinite(row[key]), (key, row)
        for peer in PEERS:  # three timed rounds after the warm-up; the median is one of them
            rounds = row[f"{peer}_rounds_s"]
            assert len(rounds) == 3 and sorted(rounds)[1] / (row["steps"] - 1) * 1e3 == pytest.approx(
                row[f"{peer}_step_ms"])
            assert (row[f"{peer}_pct_roofline_spec"] is None) == (res["spec_bandwidth_GBps"] is None)
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
    check_meta(res["meta"], device)


def test_step_profile_smoke(tmp_path: Path, model_path) -> None:
    """bench/step_profile.py on CPU: the host functions per thread, and what ran per loop."""
    model_path("tiny")
    out = tmp_path / "step_profile.json"
    argv = [sys.executable, str(SCRIPT.with_name("step_profile.py")), "--model", "tiny", "--device", "cpu",
            "--batches", "1", "--context", "16", "--steps", "4", "--loops", "normal", "--out", str(out)]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [r["loop"] for r in res["runs"]] == ["normal"] and res["runs"][0]["rows"]
    check_meta({"environment": res["meta"]["environment"], "engine": res["meta"]["engines"]["normal"]}, "cpu")


def test_spec_bandwidth_table() -> None:
    """The second roofline's bandwidth: by the GPU's name, None where the card is unknown."""
    spec_bandwidth = bench_module("gpu_specs").spec_bandwidth

    assert spec_bandwidth("NVIDIA H200") == 4.8e12
    assert spec_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert spec_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert spec_bandwidth("NVIDIA A10G") is None and spec_bandwidth(None) is None


def test_a_layer_ops_fallback_is_recorded_and_warned(capsys: pytest.CaptureFixture[str]) -> None:
    """layer_ops=auto keeps the torch ops when FlashInfer's fail their warm-up (a log line, before):
    the result says requested auto, planned flashinfer, chosen torch, and stderr warns."""
    from types import SimpleNamespace

    from tandem.engine.engine_config import EngineConfig

    run_meta = bench_module("run_meta")
    runner = SimpleNamespace(config=SimpleNamespace(layer_ops="auto"), _choose_layer_ops=lambda: "flashinfer",
                             layer_ops_name="torch", attn_backend=object(), graph_runner=None, page_size=1,
                             dtype="torch.bfloat16", device="cuda:0", kv_pool=SimpleNamespace(capacity_tokens=8))
    eng = SimpleNamespace(config=EngineConfig(), scheduler=SimpleNamespace(runner=runner))
    meta = run_meta.engine_meta(eng)
    assert meta["layer_ops"] == {"requested": "auto", "planned": "flashinfer", "chosen": "torch", "fell_back": True}
    assert "layer ops fell back" in capsys.readouterr().err


def test_a_failing_hf_peer_loses_only_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that cannot run here (a compile without a compiler, a graph break) is recorded as
    `<peer>_error`; the Engine's and the other peers' rows stand, each from three timed rounds."""
    import argparse
    from types import SimpleNamespace

    import torch

    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # gpu_decode imports its siblings by name
    gd = bench_module("gpu_decode")

    class Engine:
        def flush_cache(self) -> list:
            return [SimpleNamespace(ok=True)]

        def generate(self, prompts: list, sp: dict) -> list[dict]:
            meta = {"ttft": 0.0, "completion_tokens": sp["max_new_tokens"], "cached_tokens": 15, "prompt_tokens": 16}
            return [{"meta": meta} for _ in prompts]

    class Broken(gd.HFPeer):
        def generate(self, hf: object, ids: torch.Tensor, n: int) -> torch.Tensor:
            raise RuntimeError("no C compiler for inductor")

    hf = SimpleNamespace(config=SimpleNamespace(vocab_size=100), generation_config=SimpleNamespace(pad_token_id=0),
                         generate=lambda ids, **kw: ids)
    peers = [gd.HFPeer("hf", "dynamic", False), Broken("hf_static", "static", True)]
    args = argparse.Namespace(steps=4, context=16, repeats=3)
    row = gd.decode_case(Engine(), hf, peers, 2, args, torch.device("cpu"))
    assert "no C compiler" in row["hf_static_error"] and "hf_static_step_ms" not in row
    assert len(row["engine_rounds_s"]) == 3 and len(row["hf_rounds_s"]) == 3 and "engine_over_hf" in row


def test_jit_warm_calls_the_wrappers_as_the_engine_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/jit_warm.py's attention calls, over the FlashInfer stand-in (as strict as FlashInfer 0.7's
    signatures, int32 tables, head dims and dtypes): ragged and paged prefill, decode both ways."""
    import fake_flashinfer
    import torch

    fake_flashinfer.install(monkeypatch)
    bench_module("jit_warm").attention(128, 32, 8, torch.bfloat16, torch.device("cpu"))
    assert len(fake_flashinfer.PLANS) == 4
