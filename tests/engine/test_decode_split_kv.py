"""Split-KV off at large decode batches (engine/attention/split_kv.py): the rule, the setting, the
stand-in's plan arguments (as FlashInfer 0.7 accepts them), and what the backend plans, eager and
per CUDA-graph bucket."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import fake_flashinfer
import pytest
import torch

from tandem.engine.attention import flashinfer_backend, split_kv
from tandem.engine.engine_config import EngineConfig
from tandem.engine.forward_batch import ForwardBatch, ForwardMode
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.req_table import ReqToTokenPool
from tandem.engine.model_config import RunnerConfig

BF16, I32 = torch.bfloat16, torch.int32
PAGE, HEADS, KV_HEADS, DIM = 4, 8, 2, 64


@pytest.fixture
def fi(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return fake_flashinfer.install(monkeypatch)


def test_auto_turns_the_split_off_where_flashinfers_search_would_find_one_chunk() -> None:
    """H200 (132 SMs, 264 CTAs), 8 KV heads: FlashInfer's search gives one chunk per request from
    batch 33 on; below that the split fills idle SMs and stays."""
    off = [b for b in (1, 16, 32, 33, 64, 256) if split_kv.split_kv_off(b, 8, 132, None)]
    assert off == [33, 64, 256]
    assert not split_kv.split_kv_off(256, 8, None, None)  # off CUDA there is no grid: FlashInfer decides
    assert split_kv.split_kv_off(1, 8, 132, False) and not split_kv.split_kv_off(256, 8, 132, True)
    assert split_kv.sm_count(torch.device("cpu")) is None


def test_the_setting_is_an_engine_option_that_refuses_anything_but_a_boolean() -> None:
    assert EngineConfig.from_kwargs(decode_split_kv=False).runner_config().decode_split_kv is False
    assert EngineConfig().runner_config().decode_split_kv is None
    with pytest.raises(ValueError, match="decode_split_kv must be true, false or null"):
        EngineConfig.from_kwargs(decode_split_kv="false")


def _tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.tensor([0, 2, 3], dtype=I32), torch.tensor([5, 2, 7], dtype=I32), torch.tensor([2, 1], dtype=I32)


def test_the_standin_plan_takes_the_split_arguments_as_flashinfer_does(fi: ModuleType) -> None:
    """fixed_split_size only with tensor cores; disable_split_kv on either kernel (the CUDA-core
    one ignores it); under graphs a tensor-core wrapper keeps the form it was first planned with."""
    ws = torch.empty(8, dtype=torch.uint8)
    args = (*_tables(), HEADS, KV_HEADS, DIM, PAGE)
    core = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=False)
    with pytest.raises(ValueError, match="only supported by tensor core decode"):
        core.plan(*args, q_data_type=BF16, fixed_split_size=4)
    core.plan(*args, q_data_type=BF16, disable_split_kv=True)
    fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True).plan(
        *args, q_data_type=BF16, fixed_split_size=4)

    bufs = flashinfer_backend.graph_index_buffers(2, 4, "cpu")
    graph = fi.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=bufs[0],
        paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2])
    graph.plan(*args, q_data_type=BF16, disable_split_kv=True)
    landed = torch.cpu.Event()
    landed.record()
    landed.synchronize()
    with pytest.raises(ValueError, match="disable_split_kv changed"):
        graph.plan(*args, q_data_type=BF16, disable_split_kv=False)


def _backend(setting: bool | None) -> flashinfer_backend.FlashInferAttentionBackend:
    ctx = SimpleNamespace(
        req_to_token_pool=ReqToTokenPool(8, 64, "cpu"),
        kv_pool=TokenToKVPool(256 // PAGE + 1, PAGE, 1, KV_HEADS, DIM, BF16, "cpu"),
        device=torch.device("cpu"), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, scaling=DIM**-0.5,
        dtype=BF16, page_size=PAGE, config=RunnerConfig(decode_split_kv=setting))
    return flashinfer_backend.FlashInferAttentionBackend(ctx)


def _decode_batch(backend: flashinfer_backend.FlashInferAttentionBackend, bs: int) -> ForwardBatch:
    ctx = backend.ctx
    rows = ctx.req_to_token_pool.alloc(bs)
    locs = []
    for row in rows:
        slots = ctx.kv_pool.allocator.alloc(5)
        ctx.req_to_token_pool.write(row, 0, slots)
        locs.append(slots[-1])
    return ForwardBatch.build(ForwardMode.DECODE, [0] * bs, rows, [4] * bs, [1] * bs, torch.stack(locs), "cpu")


@pytest.mark.parametrize("setting,off", [(None, {4: True, 2: False}), (True, {4: False, 2: False}),
                                         (False, {4: True, 2: True})])
def test_the_backend_plans_each_decode_by_its_batch_size(fi: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                         setting: bool | None, off: dict[int, bool]) -> None:
    """With 4 SMs and 2 KV heads the grid is full from batch 4: eager plans and every graph
    bucket's plans follow the batch size, so a bucket's wrapper is planned alike every time."""
    monkeypatch.setattr(split_kv, "sm_count", lambda device: 4)
    backend = _backend(setting)
    states = backend.graph_states([2, 4], 4)
    for bs in (4, 2):
        batch = _decode_batch(backend, bs)
        backend.init_forward_metadata(batch)
        for _ in range(2):
            backend.plan_graph_decode(states[bs], batch)
    plans = [p for p in fake_flashinfer.PLANS if p.kind in ("decode", "fast-decode")]  # replays re-plan fast
    assert [(p.batch, p.split_kv_off) for p in plans] == [(bs, off[bs]) for bs in (4, 4, 4, 2, 2, 2)]


@pytest.mark.gpu
def test_real_decode_gives_the_same_attention_split_or_not_under_a_graph() -> None:
    """FlashInfer's tensor-core decode in a captured bucket, planned with disable_split_kv False and
    True (at batch 4 the search splits these lengths: the two forms really differ), against dense
    attention."""
    from test_attention_contract import _dense  # dense attention over the same HEADS, KV_HEADS, DIM

    lens, outs, page = [300, 17, 1000, 64], {}, 16
    torch.manual_seed(0)
    ctx = SimpleNamespace(
        req_to_token_pool=ReqToTokenPool(8, 1024, "cuda"), kv_pool=TokenToKVPool(100, page, 1, KV_HEADS, DIM, BF16,
                                                                                   "cuda"),
        device=torch.device("cuda"), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, scaling=DIM**-0.5,
        dtype=BF16, page_size=page, config=RunnerConfig())
    rows = ctx.req_to_token_pool.alloc(len(lens))
    full, locs = [], []
    for row, n in zip(rows, lens):
        slots = ctx.kv_pool.allocator.alloc(n)
        ctx.req_to_token_pool.write(row, 0, slots)
        k, v = (torch.randn(n, ctx.num_kv_heads, ctx.head_dim, dtype=BF16, device="cuda") for _ in range(2))
        ctx.kv_pool.set_kv(0, slots.to("cuda"), k, v)
        full.append((k, v))
        locs.append(slots[-1])
    batch = ForwardBatch.build(ForwardMode.DECODE, [0] * len(lens), rows, [n - 1 for n in lens], [1] * len(lens),
                               torch.stack(locs), "cuda")
    q = torch.randn(len(lens), ctx.num_heads, ctx.head_dim, dtype=BF16, device="cuda")
    for setting in (True, False):
        ctx.config = RunnerConfig(decode_split_kv=setting)
        backend = flashinfer_backend.FlashInferAttentionBackend(ctx)
        state = backend.graph_states([len(lens)], 1024 // page)[len(lens)]
        backend.plan_graph_decode(state, batch)
        backend.use_graph_state(state)
        backend.forward_decode(q, None, None, 0, batch)  # builds and loads the kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = backend.forward_decode(q, None, None, 0, batch)
        graph.replay()
        outs[setting] = out.clone()
    for i, (k, v) in enumerate(full):
        want = _dense(q[i : i + 1], k, v, lens[i] - 1)
        for setting, out in outs.items():
            torch.testing.assert_close(out[i : i + 1].float(), want, atol=2e-2, rtol=2e-2, msg=str(setting))
