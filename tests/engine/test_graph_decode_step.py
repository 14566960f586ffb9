"""The graph-captured decode step through the real scheduler, on CPU.

On a GPU a decode step is one buffer fill, one copy, one plan and one replay: futures resolve,
table cells are written, the page table is gathered, the greedy sample is taken and stored as
the next step's future, all inside the graph (runner/graph_inputs.py). Here the same path runs
over the FlashInfer stand-in (which checks that the fixed buffers the graph fills agree with the
host's fast plan) and a capture that re-runs the step at replay, against the same backend run
eagerly: the tokens must be identical, for greedy and sampled requests, with logprobs, under both
loops, and the pools whole after.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_checks import assert_whole

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


class _ReRun:
    """A capture that re-runs the step at replay, writing the output a real replay writes."""

    def capture(self, fn):
        out = fn()
        return SimpleNamespace(replay=lambda: out.copy_(fn())), out


def _flashinfer_on_cpu(monkeypatch, graphs: bool) -> None:
    """Every runner built from here on plans attention with the FlashInfer backend (its stand-in),
    keeps a host mirror of its request table as on a GPU, and, with `graphs`, runs decode steps
    through the graph runner."""
    import fake_flashinfer

    from tandem.engine.attention.flashinfer_backend import FlashInferAttentionBackend
    from tandem.engine.kvcache import kv_memory
    from tandem.engine.kvcache.req_table import ReqToTokenPool
    from tandem.engine.runner.cuda_graph_runner import CudaGraphRunner
    from tandem.engine.runner.model_runner import ModelRunner

    fake_flashinfer.install(monkeypatch)
    monkeypatch.setattr(kv_memory, "ReqToTokenPool", functools.partial(ReqToTokenPool, host_mirror=True))
    attach = getattr(ModelRunner.attach, "unpatched", ModelRunner.attach)

    def attach_flashinfer(self, memory):
        attach(self, memory)
        self.attn_backend = FlashInferAttentionBackend(self)
        if graphs:
            self.graph_runner = CudaGraphRunner(self, self.config.graph_max_bs, capture=_ReRun())

    attach_flashinfer.unpatched = attach  # type: ignore[attr-defined]
    monkeypatch.setattr(ModelRunner, "attach", attach_flashinfer)


def _run(engine, monkeypatch, graphs: bool, overlap: bool) -> list:
    import fake_flashinfer

    _flashinfer_on_cpu(monkeypatch, graphs)  # the stand-in's fences must outlive the build: no context
    eng = engine(dtype="bfloat16", device="cpu", page_size=4, max_running_requests=8, max_total_tokens=4096,
                 disable_overlap_schedule=not overlap)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(10, 8000, (n,), generator=g).tolist() for n in (5, 23, 9, 40, 3)]
    params = [
        {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 17, "temperature": 0.8, "seed": 3, "ignore_eos": True},  # sampled after the replay
        {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True, "return_logprob": True, "top_logprobs_num": 2},
        {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True},
    ]
    fake_flashinfer.PLANS.clear()
    out = [(r["token_ids"], r["meta"].get("logprobs")) for r in eng.generate(prompts, params)]
    if graphs:  # the replays re-planned with FlashInfer's fast plan, in padded buckets only
        fast = [p for p in fake_flashinfer.PLANS if p.kind == "fast-decode"]
        assert fast and {p.batch for p in fast} <= {1, 2, 4, 8}
    assert_whole(eng)  # the mirror check included: the graphs wrote the device's table cells
    return out


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_graph_decode_step_gives_the_eager_tokens(engine, monkeypatch, overlap: bool) -> None:
    eager = _run(engine, monkeypatch, graphs=False, overlap=overlap)
    assert _run(engine, monkeypatch, graphs=True, overlap=overlap) == eager


def test_a_greedy_decode_step_costs_the_host_a_few_torch_ops(monkeypatch) -> None:
    """bench/host_step.py's count at a small size: a greedy graph step dispatched ~95 torch ops on
    the host before the staged copy and the in-graph step (docs/benchmarks.md), about 7 after.
    A structural count, not a timing: it guards against per-step work creeping back."""
    import host_step

    row = host_step.steady_decode(4, 4, 32, "tiny", 8, count=True, patch=monkeypatch)
    assert row["plan_calls_per_step"] == pytest.approx(1.0, abs=0.3)
    assert row["ops_per_step"] <= 12, row["top_ops"]
