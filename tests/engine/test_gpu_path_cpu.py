"""The GPU path's device side, tested on CPU, so that the GPU path works by default.

Which attention backend a model gets, the CUDA-graph runner's static inputs, buckets,
padding and output contract (through a capture that re-runs the forward instead of
recording it), and the page table FlashInfer is planned with. The host side (sizing,
stream hand-off, the row-table mirror) is in test_gpu_host_side.py.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tandem.engine.attention import choose_backend, create_backend
from tandem.engine.attention.flashinfer_backend import host_page_counts, page_indices
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.engine_config import EngineConfig
from tandem.engine.model_config import RunnerConfig
from tandem.engine.runner.cuda_graph_runner import CudaGraphRunner, graph_buckets
from tandem.engine.runner.graph_inputs import DecodeGraphInputs
from tandem.engine.runner.model_runner import ModelRunner
from tandem.engine.runner.static_generate import StaticBatch
from tandem.engine.sampling_params import SamplingParams

BF16, FP32 = torch.bfloat16, torch.float32


# ---- backend choice: fp32 and unsupported head dims never reach FlashInfer -------------------
@pytest.mark.parametrize("dtype,head_dim,want", [
    (BF16, 64, "flashinfer"), (torch.float16, 128, "flashinfer"),
    (FP32, 64, "torch"),  # FlashInfer has no fp32 kernels
    (BF16, 32, "torch"), (BF16, 80, "torch"),  # nor these head dims
])
def test_auto_on_cuda_takes_flashinfer_only_where_it_runs(dtype, head_dim, want) -> None:
    assert choose_backend("auto", "cuda", dtype, head_dim, have_flashinfer=True) == want
    assert choose_backend("auto", "cuda", dtype, head_dim, have_flashinfer=False) == "torch"
    assert choose_backend("auto", "cpu", dtype, head_dim, have_flashinfer=True) == "torch"


@pytest.mark.parametrize("device,dtype,head_dim,installed,says", [
    ("cuda", FP32, 64, True, "dtype float32"),
    ("cuda", BF16, 32, True, "head_dim 32"),
    ("cuda", BF16, 64, False, "not installed"),
    ("cpu", BF16, 64, True, "needs a CUDA device"),
])
def test_explicit_flashinfer_that_cannot_run_is_refused_at_start(device, dtype, head_dim, installed, says) -> None:
    with pytest.raises(ValueError, match=says):
        choose_backend("flashinfer", device, dtype, head_dim, have_flashinfer=installed)
    with pytest.raises(ValueError, match="unknown attention backend"):
        choose_backend("triton", device, dtype, head_dim, have_flashinfer=installed)


def test_fp32_cuda_runner_context_builds_the_sdpa_backend() -> None:
    ctx = SimpleNamespace(device=torch.device("cuda"), kv_pool=SimpleNamespace(dtype=FP32), head_dim=64,
                          num_heads=4, num_kv_heads=2, config=RunnerConfig())
    assert isinstance(create_backend("auto", ctx), TorchAttentionBackend)
    with pytest.raises(ValueError, match="float32"):
        create_backend("flashinfer", ctx)


# ---- CUDA graphs ---------------------------------------------------------------------------
def test_every_captured_input_is_a_graph_owned_buffer() -> None:
    """Would have caught the per-capture `torch.arange(bs)`: freed after capture, its memory
    reused, every replay gathered logits with garbage indices."""
    inputs = DecodeGraphInputs(64, "cpu")
    for bs in graph_buckets(64):
        inputs.check_views(inputs.batch(bs))
    leaky = dataclasses.replace(inputs.batch(4), logits_indices=torch.arange(4))
    with pytest.raises(AssertionError, match="logits_indices"):
        inputs.check_views(leaky)


def test_graphs_cover_every_decode_batch_up_to_max_running_requests() -> None:
    assert RunnerConfig(max_running_requests=256).graph_max_bs == 256
    assert RunnerConfig(max_running_requests=256, cuda_graph_max_bs=64).graph_max_bs == 64
    assert RunnerConfig(max_running_requests=8, cuda_graph_max_bs=64).graph_max_bs == 8
    assert EngineConfig(cuda_graph_max_bs=96).runner_config().cuda_graph_max_bs == 96
    for max_bs in (1, 7, 160, 256):
        buckets = graph_buckets(max_bs)
        assert buckets[0] == 1 and buckets[-1] == max_bs
        assert all(b - a <= 16 for a, b in zip(buckets, buckets[1:]))


class _ReRun:
    """A capture that re-runs the forward at replay, writing the same output tensor a real
    graph replay writes: the graph runner's copying, padding and planning run as on a GPU."""

    def capture(self, fn):
        out = fn()
        return SimpleNamespace(replay=lambda: out.copy_(fn())), out


class _GraphableTorch(TorchAttentionBackend):
    """The CPU backend behind the graph hooks: its decode metadata are views of the static
    batch, so re-planning before each replay is all a graph needs."""

    supports_cuda_graph = True

    def graph_states(self, buckets, max_pages):
        return {bs: None for bs in buckets}

    def plan_graph_decode(self, state, batch):
        self.init_forward_metadata(batch)

    def use_graph_state(self, state):
        pass


def _runner(model_path) -> ModelRunner:
    cfg = RunnerConfig(dtype="float32", device="cpu", page_size=16, max_total_tokens=4096,
                       max_running_requests=8, max_context_len=256)
    return ModelRunner.load(model_path("tiny"), cfg)


def test_graph_replay_matches_eager_across_buckets_and_padding(model_path) -> None:
    runner = _runner(model_path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, runner.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 25)]
    # Different lengths: the live batch shrinks 5 -> 1 through buckets 8, 4, 2, 1 (padded rows).
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (4, 12, 7, 20, 9)]
    eager = StaticBatch(runner).generate(prompts, params)
    runner.attn_backend = _GraphableTorch(runner)
    runner.graph_runner = CudaGraphRunner(runner, 8, capture=_ReRun())
    assert StaticBatch(runner).generate(prompts, params) == eager
    runner.kv_pool.check_integrity(in_use_pages=0)
    runner.req_to_token_pool.check_integrity(in_use=0)


def test_flashinfer_backend_under_graphs_matches_its_eager_self(model_path, monkeypatch) -> None:
    """The FlashInfer backend's graph hooks (one wrapper per bucket over shared fixed buffers,
    re-planned before each replay) on CPU, over the stand-in for FlashInfer's kernels; the
    layers run FlashInfer's norm, RoPE and SiLU*mul (their stand-ins), as they do on CUDA."""
    import fake_flashinfer

    from tandem.engine.attention.flashinfer_backend import FlashInferAttentionBackend
    from tandem.engine.models import layer_ops_choice

    fake_flashinfer.install(monkeypatch)
    cfg = RunnerConfig(dtype="bfloat16", device="cpu", page_size=16, max_total_tokens=4096,
                       max_running_requests=8, max_context_len=256)
    runner = ModelRunner.load(model_path("tiny"), cfg)
    runner.attn_backend = FlashInferAttentionBackend(runner)
    runner.model.use_layer_ops(layer_ops_choice.build("flashinfer", runner.model))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, runner.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 25)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (4, 12, 7, 20, 9)]
    eager = StaticBatch(runner).generate(prompts, params)
    runner.graph_runner = CudaGraphRunner(runner, 8, capture=_ReRun())
    fake_flashinfer.PLANS.clear()
    assert StaticBatch(runner).generate(prompts, params) == eager
    # Replays re-plan with FlashInfer's fast plan (the graph fills the index buffers itself; the
    # stand-in's run checks they agree with the plan), in padded buckets only.
    decode_plans = [p for p in fake_flashinfer.PLANS if p.kind == "fast-decode"]
    assert decode_plans and {p.batch for p in decode_plans} <= {1, 2, 4, 8}
    assert all(p.host_indptr for p in fake_flashinfer.PLANS)
    runner.kv_pool.check_integrity(in_use_pages=0)
    runner.req_to_token_pool.check_integrity(in_use=0)


def test_flashinfer_gets_a_zeroed_workspace(monkeypatch) -> None:
    """FlashInfer's docstrings ask for a zero-initialised workspace. While the backend is built
    the allocator returns garbage, as a reused CUDA block holds; every wrapper must still get
    the one workspace, all zero."""
    import fake_flashinfer

    from tandem.engine.attention.flashinfer_backend import FlashInferAttentionBackend

    fake_flashinfer.install(monkeypatch)
    ctx = SimpleNamespace(device=torch.device("cpu"), num_heads=8, num_kv_heads=2, config=RunnerConfig())
    empty = torch.empty
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(0xA5))
        backend = FlashInferAttentionBackend(ctx)
        states = backend.graph_states([1, 2], max_pages=4)
    handed = [backend.prefill_wrapper.workspace, backend.ragged_wrapper.workspace, backend.decode_wrapper.workspace,
              *(s.wrapper.workspace for s in states.values())]
    assert all(w is backend.workspace for w in handed)
    assert backend.workspace.numel() > 0 and not backend.workspace.any()


def test_the_warm_up_runs_both_prefill_kernels_on_row_0_and_page_0_only(model_path, monkeypatch) -> None:
    """ModelRunner.warm_up (run at attach on CUDA, where FlashInfer JIT-builds its kernels on first
    use): the ragged and the paged prefill each plan and run once, and the pools stay untouched."""
    import fake_flashinfer

    from tandem.engine.attention.flashinfer_backend import FlashInferAttentionBackend

    fake_flashinfer.install(monkeypatch)
    cfg = RunnerConfig(dtype="bfloat16", device="cpu", page_size=16, max_total_tokens=1024,
                       max_running_requests=4, max_context_len=256)
    runner = ModelRunner.load(model_path("tiny"), cfg)
    runner.attn_backend = FlashInferAttentionBackend(runner)
    fake_flashinfer.PLANS.clear()
    runner.warm_up()
    assert [p.kind for p in fake_flashinfer.PLANS] == ["ragged", "prefill"]
    runner.kv_pool.check_integrity(in_use_pages=0)
    runner.req_to_token_pool.check_integrity(in_use=0)


def test_decode_kernel_choice_follows_heads_per_kv_head_unless_configured() -> None:
    from tandem.engine.attention.flashinfer_backend import decode_tensor_cores

    def ctx(heads: int, kv: int, forced: bool | None = None) -> SimpleNamespace:
        return SimpleNamespace(num_heads=heads, num_kv_heads=kv, config=RunnerConfig(decode_tensor_cores=forced))

    assert decode_tensor_cores(ctx(32, 8)) and not decode_tensor_cores(ctx(16, 8))
    assert not decode_tensor_cores(ctx(32, 8, False)) and decode_tensor_cores(ctx(16, 16, True))


def test_graph_memory_counts_what_the_graph_runner_allocates(model_path, monkeypatch) -> None:
    """The reserve's count of graph-owned memory (runner/graph_memory.py) against the buffers a
    FlashInfer graph runner really holds: static inputs, the shared page-table buffers, one
    logits output per bucket. The pool's activations exist only on a GPU: estimated, not measured."""
    import fake_flashinfer

    from tandem.engine.attention.flashinfer_backend import FlashInferAttentionBackend
    from tandem.engine.runner.graph_memory import graph_memory

    fake_flashinfer.install(monkeypatch)
    cfg = RunnerConfig(dtype="bfloat16", device="cpu", page_size=16, max_total_tokens=1024,
                       max_running_requests=40, max_context_len=200)
    runner = ModelRunner.load(model_path("tiny"), cfg)
    runner.attn_backend = FlashInferAttentionBackend(runner)
    graphs = CudaGraphRunner(runner, cfg.graph_max_bs, capture=_ReRun())
    largest = graphs.states[graphs.max_bs]
    counted = graph_memory(runner.model_config, cfg, BF16, runner.max_context_len)
    assert counted.inputs == sum(b.nbytes for b in graphs.inputs.buffers())
    assert counted.index == sum(t.untyped_storage().nbytes() for t in (largest.indptr, largest.indices, largest.last))
    outputs = sum(o.nbytes for o in graphs.outputs.values())
    assert counted.outputs == outputs == (1 + 2 + 4 + 8 + 16 + 32 + 40) * runner.vocab_size * 4
    assert counted.pool > 0 and counted.total == counted.inputs + counted.index + counted.outputs + counted.pool


def test_forward_under_graphs_returns_the_static_output_until_the_next_forward(model_path) -> None:
    """The documented contract of ModelRunner.forward: a view, overwritten by the next replay."""
    runner = _runner(model_path)
    runner.attn_backend = _GraphableTorch(runner)
    runner.graph_runner = CudaGraphRunner(runner, 4, capture=_ReRun())
    sb = StaticBatch(runner)
    seqs = sb.new(2)
    sb.forward(seqs, [[11, 12, 13], [14, 15]])
    first = sb.forward(seqs, [[20], [21]])
    kept = first.clone()
    second = sb.forward(seqs, [[22], [23]])
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert torch.equal(first, second) and not torch.equal(kept, second)
    sb.release(seqs)
    runner.kv_pool.check_integrity(in_use_pages=0)
    runner.req_to_token_pool.check_integrity(in_use=0)


# ---- the page table FlashInfer is planned with ------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16])
def test_page_table_is_built_on_the_device_tensors_and_matches_the_rows(page_size) -> None:
    table = torch.randint(0, 10_000, (6, 128), dtype=torch.int32)
    rows, lens = [4, 0, 2, 0], [37, 1, 128, 16]  # a padded graph row: row 0, seq_len 1
    indptr, last = host_page_counts(lens, page_size)
    got = page_indices(table, torch.tensor(rows), torch.tensor(lens, dtype=torch.int32), int(indptr[-1]), page_size)
    want = torch.cat([table[r, 0:n:page_size] // page_size for r, n in zip(rows, lens)]).to(torch.int32)
    assert torch.equal(got, want)
    assert indptr.device.type == last.device.type == "cpu"  # plan reads host copies: none made from the GPU
    assert indptr.tolist() == [0, *torch.tensor([-(-n // page_size) for n in lens]).cumsum(0).tolist()]
    assert last.tolist() == [(n - 1) % page_size + 1 for n in lens]
