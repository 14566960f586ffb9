"""RoPE with the K/V store (layer_ops.py `qk_rope_store`) over every implementation, each held bit
for bit to its unfused chain: its own `qk_rope`, then k and v into the pool slots.

    torch, cpu-kernels   the chain itself (they never fuse; their forwards keep the backend's store)
    flashinfer-standin   FlashInferLayerOps' fused Triton kernel (kvcache/rope_kv_triton.py) through
                         Triton's interpreter, against the stand-in's RoPE (fp32, one rounding)
    flashinfer           the same on the GPU, against that chain computed by torch ops; FlashInfer's
                         own RoPE (which may contract a multiply-add) within one rounding of it; and
                         the kernel inside a CUDA graph, replayed over new inputs in its static buffers

Each runs Llama/Qwen2 (no qk-norm) and Qwen3 (qk-norm, then RoPE) heads at head dims 64 and 128,
page sizes 1 and 16. The kernel alone is also held to the torch chain in fp32, where one rounding
and the chain's three are the same. Triton's interpreter is set before Triton is imported, so the
checks run in a child process. The last test runs whole models through the FlashInfer backend
(stand-in) with the fused path on and off: the same logits, eager and through the graph runner.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parents[1] / "support"
IMPLS = ["torch", "cpu-kernels", "flashinfer-standin", pytest.param("flashinfer", marks=pytest.mark.gpu)]


def _run_in_child(check: str, impl: str, interpret: bool) -> None:
    """`check` (a script that prints "same") in a fresh interpreter."""
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", f"IMPL = {impl!r}\n" + check], env=env, capture_output=True,
                         text=True, timeout=600, cwd="/")
    if out.returncode == 0 and out.stdout.strip() == "skip":
        pytest.skip("the CPU kernels are not built on this machine")
    assert out.stdout.strip() == "same", out.stdout[-2000:] + out.stderr[-3000:]


_CONTRACT = """
import copy
import torch
from transformers import LlamaConfig
from tandem.engine.kernels import cpu_kernels
from tandem.engine.kvcache import rope_kv_triton
from tandem.engine.kvcache.kv_slots import KVSlots
from tandem.engine.models import layer_ops
from tandem.engine.models.layer_ops import TORCH, Heads
from tandem.engine.models.rotary import RotaryEmbedding

if IMPL == "cpu-kernels" and not cpu_kernels.enabled("layer_ops"):
    print("skip")
    raise SystemExit
device = "cuda" if IMPL == "flashinfer" else "cpu"
if IMPL == "flashinfer-standin":
    import fake_flashinfer
    from _pytest.monkeypatch import MonkeyPatch
    fake_flashinfer.install(MonkeyPatch())
if IMPL.startswith("flashinfer"):
    from tandem.engine.models.flashinfer_ops import FlashInferLayerOps as make
    dtypes = [torch.bfloat16, torch.float16]
else:
    make = lambda rotary: layer_ops.CpuKernelOps() if IMPL == "cpu-kernels" else TORCH
    dtypes = [torch.float32, torch.bfloat16]

def rotary_of(dim):
    cfg = LlamaConfig(hidden_size=4 * dim, num_attention_heads=4, head_dim=dim,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 512})
    return RotaryEmbedding(cfg, dim, 4096).to(device)

def slots_of(page_size, n, g):
    # whole pages from a shuffled pool, filled in order: a page-16 pool's layout; page 1 is any order
    pages = (torch.randperm(40, generator=g)[: -(-n // page_size)] + 1) * page_size
    return (pages[:, None] + torch.arange(page_size)[None, :]).flatten()[:n].to(device)

def one_rounding_chain(qkv, table, positions, heads, norms, slots, ops):
    # FlashInfer's RoPE formula (the stand-in's, plain torch: fp32, rounded once), then the store
    import fake_flashinfer_ops
    q, k, v = ops._qk_norm(qkv, heads, *norms, 1e-6) if norms[0] is not None else heads.split(qkv)
    fake_flashinfer_ops.apply_rope_with_cos_sin_cache_inplace(positions, q, k, heads.dim, table)
    slots.k_buffer.index_copy_(0, slots.loc, k)
    slots.v_buffer.index_copy_(0, slots.loc, v)
    return q, k, v

def run(fn, qkv, buffers, loc, *args):
    rows, (kb, vb) = qkv.clone(), (b.clone() for b in buffers)
    q, k, v = fn(rows, *args, KVSlots(kb, vb, loc))
    return [rows, q, k, v, kb, vb]

g = torch.Generator().manual_seed(0)
for dim, hq, hkv in ((64, 8, 2), (128, 4, 4)):
    heads, rotary = Heads(hq, hkv, dim), rotary_of(dim)
    for dtype in dtypes:
        tables = copy.deepcopy(rotary).to(dtype)  # cast at load, as HF casts its cos/sin
        ops = make(tables)
        for page_size in (1, 16):
            for qk_norm in (False, True):
                n = 29
                qkv = torch.randn(n, (hq + 2 * hkv) * dim, generator=g).to(dtype).to(device)
                norms = [torch.randn(dim, generator=g).to(dtype).to(device) if qk_norm else None for _ in range(2)]
                positions = torch.randint(0, 4096, (n,), generator=g).to(device)
                buffers = [torch.zeros(41 * page_size, hkv, dim, dtype=dtype, device=device) for _ in range(2)]
                loc = slots_of(page_size, n, g)
                rope = ops.rope_batch(tables, positions, dtype)
                fused = run(lambda r, s: ops.qk_rope_store(r, rope, heads, *norms, 1e-6, s), qkv, buffers, loc)
                chain = run(lambda r, s: layer_ops.rope_then_store(ops, r, rope, heads, *norms, 1e-6, s),
                            qkv, buffers, loc)
                case = (IMPL, dim, dtype, page_size, qk_norm)
                if IMPL == "flashinfer":  # FlashInfer's RoPE may contract a multiply-add: one rounding apart
                    ulp = torch.finfo(dtype).eps
                    for a, b in zip(fused, chain):
                        assert ((a.float() - b.float()).abs() <= ulp * b.float().abs().clamp(min=1)).all(), case
                    chain = run(lambda r, s: one_rounding_chain(r, rope.cos, positions, heads, norms, s, ops),
                                qkv, buffers, loc)
                for a, b in zip(fused, chain):
                    assert a.shape == b.shape and torch.equal(a, b), case
                untouched = torch.ones(len(buffers[0]), dtype=torch.bool, device=device)
                untouched[loc] = False
                assert not fused[4][untouched].any() and not fused[5][untouched].any(), case

    if IMPL.startswith("flashinfer"):  # the kernel alone in fp32: the torch chain exactly
        qkv = torch.randn(7, (hq + 2 * hkv) * dim, generator=g).to(device)
        positions, loc = torch.randint(0, 4096, (7,), generator=g).to(device), slots_of(1, 7, g)
        buffers = [torch.zeros(41, hkv, dim, device=device) for _ in range(2)]
        half = dim // 2
        table = torch.cat([rotary.cos[:, :half], rotary.sin[:, :half]], dim=-1).float().contiguous()
        def kernel(rows, slots):
            q, k, v = heads.split(rows)
            rope_kv_triton.rope_store(q, k, v, positions, table, slots.k_buffer, slots.v_buffer, slots.loc)
            return q, k, v
        fused = run(kernel, qkv, buffers, loc)
        chain = run(lambda r, s: layer_ops.rope_then_store(TORCH, r, TORCH.rope_batch(rotary, positions, torch.float32),
                                                           heads, None, None, 1e-6, s), qkv, buffers, loc)
        # q, k, v and the pool (the torch chain leaves qkv's own columns alone)
        assert all(torch.equal(a, b) for a, b in zip(fused[1:], chain[1:])), (dim, "fp32")

if IMPL == "flashinfer":  # under a CUDA graph: static inputs, new values at every replay
    heads, rotary = Heads(8, 2, 64), rotary_of(64)
    tables = copy.deepcopy(rotary).to(torch.bfloat16)
    ops, n = make(tables), 16
    qkv = torch.zeros(n, 12 * 64, dtype=torch.bfloat16, device=device)
    positions, loc = torch.zeros(n, dtype=torch.int64, device=device), torch.zeros(n, dtype=torch.int64, device=device)
    kb, vb = (torch.zeros(41, 2, 64, dtype=torch.bfloat16, device=device) for _ in range(2))
    rope = ops.rope_batch(tables, positions, torch.bfloat16)
    step = lambda: ops.qk_rope_store(qkv, rope, heads, None, None, 1e-6, KVSlots(kb, vb, loc))
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        new = torch.randn(n, 12 * 64, generator=g).to(torch.bfloat16)
        qkv.copy_(new)
        positions.copy_(torch.randint(0, 4096, (n,), generator=g))
        loc.copy_(slots_of(1, n, g))
        graph.replay()
        eager = run(lambda r, s: ops.qk_rope_store(r, rope, heads, None, None, 1e-6, s), new.to(device),
                    (kb * 0, vb * 0), loc)
        assert torch.equal(qkv, eager[0])
        assert torch.equal(kb[loc], eager[4][loc]) and torch.equal(vb[loc], eager[5][loc])
print("same")
"""


@pytest.mark.parametrize("impl", IMPLS)
def test_rope_with_the_kv_store_equals_rope_then_store(impl: str) -> None:
    _run_in_child(_CONTRACT, impl, interpret=impl == "flashinfer-standin")


_MODELS = """
import torch
import fake_flashinfer
from types import SimpleNamespace
from _pytest.monkeypatch import MonkeyPatch
from tandem.engine.attention.flashinfer_backend import FlashInferAttentionBackend
from tandem.engine.model_config import RunnerConfig
from tandem.engine.kvcache import rope_kv_triton
from tandem.engine.models import layer_ops_choice
from tandem.engine.runner.cuda_graph_runner import CudaGraphRunner
from tandem.engine.runner.model_runner import ModelRunner
from tandem.engine.runner.static_generate import StaticBatch
from tandem.engine.sampling_params import SamplingParams

mp = MonkeyPatch()
fake_flashinfer.install(mp)
mp.setattr(rope_kv_triton, "available", lambda device: True)  # the interpreter runs it on CPU
launches = []
fused_kernel = rope_kv_triton.rope_store
mp.setattr(rope_kv_triton, "rope_store", lambda *a: launches.append(1) or fused_kernel(*a))

class ReRun:  # a capture that re-runs the forward at replay (tests/engine/test_gpu_path_cpu.py)
    def capture(self, fn):
        out = fn()
        return SimpleNamespace(replay=lambda: out.copy_(fn())), out

def run(path, page_size, fused):
    cfg = RunnerConfig(dtype="bfloat16", device="cpu", page_size=page_size, max_total_tokens=2048,
                       max_running_requests=4, max_context_len=128, fused_rope_kv=fused)
    runner = ModelRunner.load(path, cfg)
    runner.attn_backend = FlashInferAttentionBackend(runner)
    runner.model.use_layer_ops(layer_ops_choice.build("flashinfer", runner.model))
    sb = StaticBatch(runner)
    seqs = sb.new(2)
    logits = [sb.forward(seqs, [[5 + i for i in range(13)], [40 + i for i in range(6)]]).clone()]
    logits += [sb.forward(seqs, [[7 + t], [90 + t]]).clone() for t in range(3)]
    sb.release(seqs)
    runner.graph_runner = CudaGraphRunner(runner, 4, capture=ReRun())
    greedy = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0)
    tokens = StaticBatch(runner).generate([[3, 1, 4, 1, 5], [9, 2, 6]], [greedy, greedy])
    runner.kv_pool.check_integrity(in_use_pages=0)
    return torch.stack(logits), tokens

for path, page_size in zip(PATHS, (16, 1)):
    launches.clear()
    unfused = run(path, page_size, False)
    assert not launches
    fused = run(path, page_size, True)
    assert launches, "the fused kernel ran"
    assert torch.equal(fused[0], unfused[0]), (path, page_size)
    assert fused[1] == unfused[1], (path, page_size)
print("same")
"""


def test_models_give_the_same_logits_with_rope_and_the_store_fused(model_path) -> None:
    """Qwen3 (qk-norm) and Llama through the FlashInfer backend (stand-in) and its layer ops, bf16:
    the fused kernel (interpreted) gives the unfused path's logits bit for bit, prefill and decode,
    eager and through the graph runner (Qwen3 at page size 16, Llama at 1)."""
    paths = [str(model_path(arch)) for arch in ("tiny", "tiny-llama")]
    _run_in_child(f"PATHS = {paths!r}\n" + _MODELS, "flashinfer-standin", interpret=True)


def test_the_backend_offers_its_slots_only_where_the_kernel_runs(monkeypatch) -> None:
    """fused_rope_kv: None takes the fused path where Triton runs (CUDA), False never, and True
    where it cannot run is refused when the backend is built, never mid-forward."""
    from types import SimpleNamespace

    import fake_flashinfer
    import torch

    from tandem.engine.attention.flashinfer_backend import FlashInferAttentionBackend
    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.kvcache import rope_kv_triton
    from tandem.engine.kvcache.memory_pool import TokenToKVPool
    from tandem.engine.kvcache.req_table import ReqToTokenPool
    from tandem.engine.model_config import RunnerConfig

    fake_flashinfer.install(monkeypatch)

    def backend(setting: bool | None, head_dim: int = 64, kv_dtype: torch.dtype = torch.bfloat16
                ) -> FlashInferAttentionBackend:
        return FlashInferAttentionBackend(SimpleNamespace(
            req_to_token_pool=ReqToTokenPool(2, 16, "cpu"),
            kv_pool=TokenToKVPool(9, 1, 3, 2, head_dim, kv_dtype, "cpu"), device=torch.device("cpu"),
            num_heads=8, num_kv_heads=2, head_dim=head_dim, scaling=0.1, dtype=torch.bfloat16, page_size=1,
            config=RunnerConfig(fused_rope_kv=setting)))

    batch = SimpleNamespace(out_cache_loc=torch.tensor([3, 5]))
    assert backend(None).kv_slots(1, batch) is None  # CPU: the backend stores
    with pytest.raises(ValueError, match="fused_rope_kv=true needs Triton on a CUDA device"):
        backend(True)
    monkeypatch.setattr(rope_kv_triton, "available", lambda device: True)
    fused = backend(None)
    slots, pool = fused.kv_slots(1, batch), fused.ctx.kv_pool
    assert slots.loc is batch.out_cache_loc  # the batch's own (under graphs: static) slots
    assert [b.data_ptr() for b in (slots.k_buffer, slots.v_buffer)] == [pool.k_buffer(1).data_ptr(),
                                                                         pool.v_buffer(1).data_ptr()]
    assert backend(False).kv_slots(1, batch) is None
    with pytest.raises(ValueError, match="head_dim 64, 128 or 256"):
        backend(True, head_dim=96)
    assert backend(None, kv_dtype=torch.float16).kv_slots(1, batch) is None  # the store would convert
    with pytest.raises(ValueError, match="KV pool of the activation dtype"):
        backend(True, kv_dtype=torch.float16)
    with pytest.raises(ValueError, match="fused_rope_kv must be true, false or null"):
        EngineConfig.from_kwargs(fused_rope_kv="false")
    assert EngineConfig.from_kwargs(fused_rope_kv=False).runner_config().fused_rope_kv is False
