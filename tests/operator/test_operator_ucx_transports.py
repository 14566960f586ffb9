"""Every UCX transport list we ship ends in `tcp`: a copy of an RDMA example on a cluster
without RDMA (or a pair of pods UCX cannot reach over `rc`) must still connect, more slowly,
rather than fail its KV transfers. Lists are read wherever one is written: the operator's
schema description (and so the chart's generated CRDs), the examples, the chart, the docs."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from operator_support import CHART_DIR, EXAMPLES_DIR, REPO

from tandem.operator.spec.spec_schema import KV_TRANSFER

# A list in a transports field or an UCX_TLS value: `transports: [a, b]`, `UCX_TLS=a,b`,
# `UCX_TLS: "a,b"`, and a description's `UCX_TLS, e.g. [a, b]`.
LISTS = re.compile(r"transports:\s*\[([^\]]*)\]|UCX_TLS(?:, e\.g\.\s*\[([^\]]*)\]|[=:]\s*\"?([\w,]+))")


def transport_lists(text: str) -> list[list[str]]:
    return [[t.strip().strip("\"'") for t in "".join(m.groups(default="")).split(",") if t.strip()]
            for m in LISTS.finditer(text)]


def shipped_files() -> list[Path]:
    roots = [EXAMPLES_DIR, CHART_DIR, REPO / "docs", REPO / "operator"]
    return [p for root in roots for p in root.rglob("*") if p.suffix in {".yaml", ".yml", ".md", ".py", ".json"}]


def test_every_shipped_transport_list_falls_back_to_tcp() -> None:
    found = {p: transport_lists(p.read_text()) for p in shipped_files()}
    lacking = {str(p.relative_to(REPO)): ls for p, ls in found.items() for lst in ls if "tcp" not in lst}
    assert not lacking, f"UCX transport lists without tcp: {lacking}"
    named = {p.relative_to(REPO).as_posix() for p, ls in found.items() if ls}
    assert {"examples/inferenceservice-rdma.yaml", "charts/tandem/files/crds.yaml"} <= named


def test_the_schema_example_and_the_rdma_example_list_tcp() -> None:
    ucx = KV_TRANSFER["properties"]["ucx"]["properties"]
    assert transport_lists(ucx["transports"]["description"]) == [["rc", "cuda_copy", "cuda_ipc", "tcp"]]
    example = yaml.safe_load((EXAMPLES_DIR / "inferenceservice-rdma.yaml").read_text())
    assert example["spec"]["kvTransfer"]["ucx"]["transports"][-1] == "tcp"


def test_the_pattern_reads_every_form() -> None:
    text = 'transports: [rc, cuda_ipc]\nUCX_TLS=rc,tcp\n  UCX_TLS: "ud,sm"\nUCX_TLS, e.g. [rc, tcp]; empty'
    assert transport_lists(text) == [["rc", "cuda_ipc"], ["rc", "tcp"], ["ud", "sm"], ["rc", "tcp"]]
