"""`tandem bench` against a live worker: every workload gives its JSON and plot with every
request answered, and --compare reports B/A ratios over the identical request list."""

from __future__ import annotations

import json

import pytest

from tandem.cli import main
from tandem.loadgen.workloads import WORKLOADS

pytest.importorskip("matplotlib")
SMALL = ["--num-requests", "4", "--warmup", "1", "--prompt-len", "8:24", "--output-len", "4:8", "--prefix-len", "32",
         "--turns", "2", "--context-len", "400", "--no-progress"]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_workload(worker, tmp_path, workload):
    assert main(["bench", "--url", worker.url, "--workload", workload, "--concurrency", "2",
                 "--slo-ttft-ms", "60000", "--out", str(tmp_path), *SMALL]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    run = report["runs"]["A"]
    sessions = 4 * (2 if workload == "multi_turn" else 1)
    assert run["ok"] == run["requests"] == sessions and run["goodput"] == pytest.approx(run["request_throughput"])
    assert run["ttft"]["p50"] > 0 and run["output_token_throughput"] > 0 and run["input_token_throughput"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_compare_two_endpoints(worker, tmp_path, capsys):
    assert main(["bench", "--url", worker.url, "--compare", worker.url, "--labels", "one,two", "--rate", "20",
                 "--rounds", "2", "--chat", "--out", str(tmp_path), *SMALL]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert set(report["runs"]) == {"one", "two"} and report["runs"]["two"]["ok"] == 8
    assert report["ratios_b_over_a"]["request_throughput"] > 0
    assert "B/A" in capsys.readouterr().out


def test_unreachable_endpoint_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no model id from http://127.0.0.1:9"):
        main(["bench", "--url", "http://127.0.0.1:9", "--out", str(tmp_path), *SMALL])
