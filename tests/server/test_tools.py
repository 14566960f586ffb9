"""guidellm and aiperf, the load tools users already run, work unchanged against `tandem up`'s
router with the local model's tokenizer directory (the commands docs/benchmarks.md gives).

They live in their own venv (`$TANDEM_HOME/tools-venv`, made on first use: aiperf pins
pyzmq and prometheus-client below the project's versions), with the CPU torch pinned first
because guidellm depends on an unpinned torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from up_stack import Stack

TOOLS = ("guidellm==0.8.1", "aiperf==0.13.0")
REQUESTS = 8


@pytest.fixture(scope="module")
def tools_venv() -> Path:
    home = Path(os.environ.get("TANDEM_HOME", "~/.cache/tandem")).expanduser()
    venv = home / "tools-venv"
    marker = venv / ("installed-" + "-".join(TOOLS).replace("==", "_"))
    if not marker.exists():
        home.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(venv / "bin/python"), "-m", "pip", "install", "-q"]
        for step in (["torch==2.13.0"], ["torch==2.13.0", *TOOLS]):
            # `python -m` puts the cwd first on sys.path: not the repo root, whose operator/ shadows stdlib's.
            done = subprocess.run(pip + step, capture_output=True, text=True, timeout=900, cwd=home)
            if done.returncode != 0:
                pytest.skip(f"could not install {step}: {done.stderr[-1500:]}")
        marker.touch()
    return venv


@pytest.fixture(scope="module")
def stack(model_path):
    s = Stack(model_path("tiny"), "--no-check").wait_up()
    yield s
    assert s.stop() == 0, s.output()
    s.assert_gone()


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> None:
    # Not from the repo root: its operator/ folder would shadow stdlib `operator` in their workers.
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])


def test_guidellm(tools_venv, stack, model_path, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    _run([str(tools_venv / "bin/guidellm"), "run",
          "--backend", f"kind=openai_http,target={stack.url},model=tiny",
          "--tokenizer", f"kind=huggingface_auto,model={model_path('tiny')}",
          "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
          "--profile", "kind=concurrent,streams=4",
          "--constraint", f"kind=max_requests,count={REQUESTS}",
          "--output", f"kind=json,path={tmp_path / 'benchmarks.json'}",
          "--disable-console-interactive"], tmp_path, env)
    bench = json.loads((tmp_path / "benchmarks.json").read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    assert totals["successful"] == REQUESTS and totals["errored"] == 0, totals
    assert bench["metrics"]["time_to_first_token_ms"]["successful"]["percentiles"]["p50"] > 0


def test_aiperf(tools_venv, stack, model_path, tmp_path):
    # aiperf sends even a local tokenizer directory through the hub client when offline mode is set.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    _run([str(tools_venv / "bin/aiperf"), "profile", "--model", "tiny", "--url", stack.url,
          "--endpoint-type", "chat", "--streaming", "--tokenizer", str(model_path("tiny")),
          "--isl", "64", "--isl-stddev", "0", "--osl", "16", "--extra-inputs", "ignore_eos:true",
          "--use-server-token-count", "--request-count", str(REQUESTS), "--concurrency", "4",
          "--random-seed", "42", "--ui", "none", "--no-gpu-telemetry", "--artifact-dir", str(tmp_path)],
         tmp_path, {**env, "HF_HUB_DISABLE_TELEMETRY": "1"})
    summary = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == REQUESTS, summary.get("error_summary")
    assert summary["time_to_first_token"]["p50"] > 0
