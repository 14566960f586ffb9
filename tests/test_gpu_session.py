"""bench/gpu_session.sh in its dry mode (DRY=1: CPU, the tiny model, no GPU kit): every phase
leaves one archive and a summary in $OUT (a device call returns at most 8 files), with the
result JSONs inside, each saying what ran (bench/run_meta.py); a step past its limit, a call
past its budget, or a call killed outright still leave what finished. And docs/gpu.md's commands
for the next GPU session name the phases and knobs the script has."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from smoke import full
from waits import wait_until

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_session.sh"
# What each phase's dry run leaves in its archive (the GPU run adds its tests' logs and compiled modules).
EXPECTED = {
    1: {"gpu_decode_1b_auto.json", "gpu_decode_1b_torch-ops.json"},
    2: {"kv_transfer_cpu.json", "kv_transfer_heads_staged_cpu.json", "kv_transfer_to_wider_staged_cpu.json"},
    3: {"gpu_decode_8b.json", "prefill_profile.json", "step_profile.json", "gpu_decode_1b_page-size-16.json"},
}


def session(phase: int, out: Path, **env: str) -> subprocess.Popen:
    full = {**os.environ, "DRY": "1", "PHASE": str(phase), "OUT": str(out), "PYTHON": sys.executable, **env}
    return subprocess.Popen(["bash", str(SCRIPT)], cwd=ROOT, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def run(phase: int, out: Path, timeout: float = 170, **env: str) -> str:
    proc = session(phase, out, **env)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, log[-3000:]
    return log


def archive(out: Path, phase: int) -> dict[str, bytes]:
    with tarfile.open(out / f"gpu-session-p{phase}.tar.gz") as tar:
        prefix = f"gpu-session-p{phase}/"
        return {m.name.removeprefix(prefix): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def check_meta(name: str, res: dict) -> None:
    """Every result JSON records the environment, and the engine where one ran."""
    meta = res["meta"]
    env = meta["environment"]
    assert env["device"] == "cpu" and env["device_name"] and env["versions"]["torch"], name
    assert "flashinfer" in env["versions"] and env["source_digest"] and "git_commit" in env, name
    engines = [meta["engine"]] if "engine" in meta else list(meta.get("engines", {}).values())
    if name.startswith(("gpu_decode", "prefill_profile", "step_profile")):
        assert engines, name
    for eng in engines:
        ops = eng["layer_ops"]
        assert {"requested", "planned", "chosen", "fell_back"} <= set(ops), name
        assert eng["attention_backend"] and eng["page_size"] and eng["dtype"] and "decode_kernel" in eng, name


def check_phase(phase: int, out: Path) -> dict[str, bytes]:
    files = sorted(p.name for p in out.iterdir())
    assert files == [f"gpu-session-p{phase}.tar.gz", f"summary-p{phase}.txt"]  # <= 8 come back from a call
    got = archive(out, phase)
    assert EXPECTED[phase] | {"summary", "env.json"} <= set(got), sorted(got)
    summary = got["summary"].decode()
    assert summary == (out / f"summary-p{phase}.txt").read_text()
    assert "done" in summary and not re.search(r"rc=[1-9]", summary), summary
    for name in EXPECTED[phase] | {"env.json"}:
        res = json.loads(got[name])
        if name == "env.json":
            assert res["environment"]["versions"]["torch"]
            continue
        check_meta(name, res)
    return got


def test_phase_1_dry(tmp_path: Path, model_path) -> None:
    model_path("tiny")
    run(1, tmp_path)
    got = check_phase(1, tmp_path)
    auto, torch_ops = (json.loads(got[f"gpu_decode_1b_{k}.json"]) for k in ("auto", "torch-ops"))
    assert auto["meta"]["engine"]["layer_ops"]["requested"] == "auto"
    assert torch_ops["meta"]["engine"]["layer_ops"]["chosen"] == "torch"
    assert auto["repeats"] == 3 and auto["hf_peers"] == ["hf"]  # phase 1 leaves HF's compiled peer to phase 3


@pytest.mark.slow
@pytest.mark.parametrize("phase", [2, 3])
def test_phases_2_and_3_dry(phase: int, tmp_path: Path, model_path) -> None:
    # Both phases' steps are benchmarks that have their own smoke tests: the KV-transfer bench
    # (test_bench_kv_transfer.py), and gpu_decode.py with both HF peers, prefill_profile.py and
    # step_profile.py (test_bench_gpu_decode.py). The script's own wiring (steps, budget, archive)
    # is phase 1's dry run and the tests below.
    if not full():
        pytest.skip(f"phase {phase}'s dry run is in the --full form")
    model_path("tiny")
    run(phase, tmp_path)
    got = check_phase(phase, tmp_path)
    if phase == 3:
        assert json.loads(got["gpu_decode_8b.json"])["hf_peers"] == ["hf", "hf_static"]


def test_a_step_past_its_limit_leaves_its_log_and_the_rest_runs(tmp_path: Path, model_path) -> None:
    model_path("tiny")
    run(1, tmp_path, BENCH_LIMIT="2")
    got = archive(tmp_path, 1)
    summary = got["summary"].decode()
    assert "decode-1b-auto rc=124" in summary and "decode-1b-torch-ops rc=124" in summary, summary
    assert "env rc=0" in summary and "done" in summary and "decode-1b-auto.log" in got


def test_a_call_out_of_budget_skips_steps_and_says_so(tmp_path: Path, model_path) -> None:
    model_path("tiny")
    run(1, tmp_path, BUDGET="30", MARGIN="20")
    summary = archive(tmp_path, 1)["summary"].decode()
    assert re.search(r"env skipped: -?\d+s of the budget left", summary), summary
    assert "decode-1b-auto skipped" in summary and "done" in summary


def test_a_killed_call_still_returns_the_steps_that_finished(tmp_path: Path, model_path) -> None:
    """The device tool kills a command at its limit; what was archived after each step stays."""
    model_path("tiny")
    proc = session(1, tmp_path)
    try:
        wait_until(lambda: "env rc=" in (tmp_path / "summary-p1.txt").read_text()
                   if (tmp_path / "summary-p1.txt").exists() else False, 60, "the env step")
        wait_until(lambda: (tmp_path / "gpu-session-p1.tar.gz").exists(), 30, "the first archive")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    got = archive(tmp_path, 1)
    assert "env.json" in got and "env rc=0" in got["summary"].decode()


def doc_commands() -> list[str]:
    """The session commands in docs/gpu.md's section for the next GPU session."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    section = text.split("## Since the first run", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    joined = "\n".join(blocks).replace("\\\n", " ")
    return [line for line in joined.splitlines() if "bench/gpu_session.sh" in line]


def test_the_docs_run_the_three_phases_with_knobs_the_script_reads() -> None:
    commands = doc_commands()
    phases = [re.search(r"\bPHASE=(\d)", c).group(1) for c in commands]
    assert phases == ["1", "2", "3"], commands
    script = SCRIPT.read_text()
    for command in commands:
        for var in re.findall(r"\b([A-Z][A-Z0-9_]*)=", command):
            assert var in ("OUT", "TANDEM_COMMIT") or re.search(rf"\$\{{?{var}\b", script), (var, command)
    section = (ROOT / "docs" / "gpu.md").read_text().split("## Since the first run", 1)[1]
    for carried in (".gpu", ".whl", ".gpu-jit"):
        assert f"`{carried}`" in section, carried
