"""The GPU path's logic, tested on CPU (issue: the GPU path works by default).

Everything here runs without a GPU: which attention backend a model gets, the CUDA-graph
runner's static inputs, buckets, padding and output contract (through a capture that
re-runs the forward instead of recording it), the device-side page table FlashInfer is
planned with, the KV-pool sizing arithmetic, the prefill chunk default, and the stream
hand-off between the scheduler and the forward thread.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from tandem.engine.attention import choose_backend, create_backend
from tandem.engine.attention.flashinfer_backend import host_page_counts, page_indices
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.engine_config import EngineConfig, default_chunked_prefill_size
from tandem.engine.kvcache.kv_memory import kv_budget_bytes, reserve_bytes
from tandem.engine.runner.config import ModelConfig, RunnerConfig
from tandem.engine.runner.cuda_graph_runner import CudaGraphRunner, graph_buckets
from tandem.engine.runner.graph_inputs import DecodeGraphInputs
from tandem.engine.runner.model_runner import ModelRunner
from tandem.engine.runner.model_worker import OverlapWorker
from tandem.engine.runner.static_generate import StaticBatch
from tandem.engine.scheduler.sampling_params import SamplingParams

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
                          num_heads=4, num_kv_heads=2)
    assert isinstance(create_backend("auto", ctx), TorchAttentionBackend)
    with pytest.raises(ValueError, match="float32"):
        create_backend("flashinfer", ctx)


# ---- CUDA graphs ---------------------------------------------------------------------------
def test_every_captured_input_is_a_graph_owned_buffer() -> None:
    """Would have caught the per-capture `torch.arange(bs)`: freed after capture, its memory
    reused, every replay gathered logits with garbage indices."""
    inputs = DecodeGraphInputs(64, "cpu")
    for bs in graph_buckets(64):
        inputs.check_views(inputs.batch(bs, [0] * bs, [1] * bs))
    leaky = inputs.batch(4, [0] * 4, [1] * 4)
    leaky.logits_indices = torch.arange(4)
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
    re-planned before each replay) on CPU, over the stand-in for FlashInfer's kernels."""
    import fake_flashinfer

    from tandem.engine.attention.flashinfer_backend import FlashInferAttentionBackend

    fake_flashinfer.install(monkeypatch)
    cfg = RunnerConfig(dtype="bfloat16", device="cpu", page_size=16, max_total_tokens=4096,
                       max_running_requests=8, max_context_len=256)
    runner = ModelRunner.load(model_path("tiny"), cfg)
    runner.attn_backend = FlashInferAttentionBackend(runner)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, runner.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 25)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (4, 12, 7, 20, 9)]
    eager = StaticBatch(runner).generate(prompts, params)
    runner.graph_runner = CudaGraphRunner(runner, 8, capture=_ReRun())
    fake_flashinfer.PLANS.clear()
    assert StaticBatch(runner).generate(prompts, params) == eager
    decode_plans = [p for p in fake_flashinfer.PLANS if p.kind == "decode"]
    assert decode_plans and {p.batch for p in decode_plans} <= {1, 2, 4, 8}  # padded buckets only
    assert all(p.host_indptr for p in fake_flashinfer.PLANS)
    runner.kv_pool.check_integrity(in_use_pages=0)


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


# ---- KV-pool sizing -----------------------------------------------------------------------------
GIB = 1 << 30


def test_kv_budget_counts_the_weights_once_and_leaves_the_reserve_free() -> None:
    # 80 GiB device, 16 GiB of weights already loaded (so 64 GiB free), 0.5 for weights + KV.
    assert kv_budget_bytes(80 * GIB, 64 * GIB, 16 * GIB, 0.5, 2 * GIB) == 24 * GIB
    # The old arithmetic, (free * fraction - weights), gave 16 GiB: the weights subtracted twice.
    # Whatever else holds memory (another process), the reserve stays free.
    assert kv_budget_bytes(80 * GIB, 20 * GIB, 16 * GIB, 0.9, 4 * GIB) == 16 * GIB
    assert kv_budget_bytes(80 * GIB, 3 * GIB, 16 * GIB, 0.9, 4 * GIB) == 0


def test_reserve_covers_activations_logits_and_graphs_on_cuda(model_path) -> None:
    mc = ModelConfig.from_pretrained(model_path("tiny"))
    small = RunnerConfig(max_running_requests=8, max_forward_tokens=512)
    big = RunnerConfig(max_running_requests=256, max_forward_tokens=8192)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert reserve_bytes(mc, big, BF16, cpu) > reserve_bytes(mc, small, BF16, cpu) > 0
    assert reserve_bytes(mc, big, BF16, cuda) - reserve_bytes(mc, big, BF16, cpu) == GIB
    chunked = EngineConfig(chunked_prefill_size=4096, max_prefill_tokens=2048)
    assert chunked.runner_config().max_forward_tokens == 4096


# ---- chunked prefill default --------------------------------------------------------------------
def test_prefill_chunk_grows_with_gpu_memory_and_stays_2048_on_cpu() -> None:
    assert default_chunked_prefill_size("cpu") == 2048
    assert default_chunked_prefill_size("cuda", 24 * GIB) == 2048
    assert default_chunked_prefill_size("cuda", 48 * GIB) == 4096
    assert default_chunked_prefill_size("cuda", 80 * GIB) == 8192
    assert EngineConfig(device="cpu").chunk_size == 2048
    assert EngineConfig(device="cpu", chunked_prefill_size=512).chunk_size == 512
    assert EngineConfig(device="cpu", chunked_prefill_size=0).chunk_size is None


# ---- overlap: the forward waits for the scheduler's writes --------------------------------------
def test_overlap_forward_waits_for_the_handoff_marked_at_launch() -> None:
    log: list[tuple[str, str, int]] = []
    marks = iter(range(100))

    class Handoff:
        def mark(self):
            token = next(marks)
            log.append(("mark", threading.current_thread().name, token))
            return token

        def wait(self, token):
            log.append(("wait", threading.current_thread().name, token))

    class Worker:
        runner = SimpleNamespace(device=torch.device("cpu"))

        def forward_batch_generation(self, mwb, future_map, idx):
            log.append(("forward", threading.current_thread().name, mwb))
            return mwb

    future_map = SimpleNamespace(alloc=lambda n: torch.arange(1, n + 1))
    ow = OverlapWorker(Worker(), future_map, handoff=Handoff())  # type: ignore[arg-type]
    futures = [ow.launch(SimpleNamespace(req_pool_indices=[0], n=i))[0] for i in range(3)]
    [f.result(timeout=10) for f in futures]
    ow.shutdown()
    launcher = threading.current_thread().name
    assert [e[:2] for e in log if e[0] == "mark"] == [("mark", launcher)] * 3
    forwards = [e for e in log if e[0] != "mark"]
    for i in range(3):  # each forward, on the forward thread, right after waiting on its own mark
        (w, wt, token), (f, ft, mwb) = forwards[2 * i], forwards[2 * i + 1]
        assert (w, f, token, mwb.n) == ("wait", "forward", i, i) and wt == ft != launcher


# ---- the scheduler reads request rows from a host mirror, never from the device ----------------
def test_scheduler_on_a_mirrored_row_table_matches_and_keeps_the_mirror_exact(monkeypatch) -> None:
    """Off the CPU the request-row table has a host mirror the scheduler reads (a request's last
    slot each decode step, its slots when it finishes or is cached), so no step waits on the
    GPU. Forced on here: same tokens as the plain table, through prefix hits, chunked prefill
    and overlap, and flush's integrity check finds the mirror equal to the table."""
    import functools

    from tandem.engine.engine import Engine
    from tandem.engine.kvcache import kv_memory
    from tandem.engine.kvcache.req_table import ReqToTokenPool

    g = torch.Generator().manual_seed(7)
    shared = torch.randint(10, 8000, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(10, 8000, (n,), generator=g).tolist() for n in (5, 70, 12, 33)]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (9, 3, 17, 6)]
    kw = dict(device="cpu", dtype="float32", page_size=4, chunked_prefill_size=32, max_total_tokens=2048,
              disable_overlap_schedule=False)

    def run() -> tuple[list[list[int]], bool]:
        with Engine("tiny", **kw) as eng:
            out = [r["token_ids"] for r in eng.generate(prompts[:1], params[:1])]  # cached, then hit
            out += [r["token_ids"] for r in eng.generate(prompts[1:], params[1:])]
            assert all(r.ok for r in eng.flush_cache())
            table = eng._backend.scheduler.runner.req_to_token_pool
            return out, table.host is not table.req_to_token

    plain, mirrored = run()
    assert not mirrored
    monkeypatch.setattr(kv_memory, "ReqToTokenPool", functools.partial(ReqToTokenPool, host_mirror=True))
    assert run() == (plain, True)
