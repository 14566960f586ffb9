"""bench/serve_variants.py end to end on the tiny model: two live servers (one differing by an
environment variable, one by a flag), every case measured on both, the ratios written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench/serve_variants.py"


def test_two_variants_paired(model_path, tmp_path):
    out = tmp_path / "variants.json"
    subprocess.run([sys.executable, str(BENCH), "--model", str(model_path("tiny")), "--variant", "base=",
                    "--variant", "heap64=MALLOC_MMAP_THRESHOLD_=65536;--max-running-requests 4",
                    "--lengths", "8", "--decode-tokens", "2", "--rounds", "2", "--out", str(out)],
                   check=True, timeout=600, capture_output=True)
    got = json.loads(out.read_text())
    assert got["base"] == "base" and set(got["base_over_variant"]) == {"base", "heap64"}
    assert got["base_over_variant"]["base"] == 1.0 and got["base_over_variant"]["heap64"] > 0
    assert set(got["summary"]) == {"prefill 8", "decode ms/token"}
    assert len(got["rows"]) == 2 * 2 and all(set(r["ms"]) == {"base", "heap64"} for r in got["rows"])
