"""The FlashInfer stand-in (tests/support/fake_flashinfer.py) is as strict as FlashInfer: what
FlashInfer refuses it refuses, what FlashInfer reads late it reads late. And the FlashInfer
backend keeps that contract where it plans again and again."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType, SimpleNamespace

import fake_flashinfer
import fake_flashinfer_copies
import pytest
import torch

from tandem.engine.attention import flashinfer_backend
from tandem.engine.forward_batch import ForwardBatch, ForwardMode
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.req_table import ReqToTokenPool
from tandem.engine.model_config import RunnerConfig

BF16, I32 = torch.bfloat16, torch.int32
PAGE, HEADS, KV_HEADS, DIM = 4, 4, 2, 64


@pytest.fixture
def fi(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return fake_flashinfer.install(monkeypatch)


def _kv(pages: int = 8, dtype: torch.dtype = BF16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(pages, PAGE, KV_HEADS, DIM, generator=g).to(dtype)
    return k, torch.randn(k.shape, generator=g).to(dtype)


def _tables() -> dict[str, torch.Tensor]:
    """Two requests: 6 tokens over pages 5 and 2, 1 token on page 7."""
    return {"indptr": torch.tensor([0, 2, 3], dtype=I32), "indices": torch.tensor([5, 2, 7], dtype=I32),
            "last": torch.tensor([2, 1], dtype=I32), "qo": torch.tensor([0, 3, 4], dtype=I32)}


def _decode(fi: ModuleType, t: dict[str, torch.Tensor], **kw: object) -> tuple[object, torch.Tensor]:
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8, dtype=torch.uint8), "NHD")
    w.plan(t["indptr"], t["indices"], t["last"], HEADS, KV_HEADS, DIM, PAGE, q_data_type=BF16,
           kv_data_type=BF16, **kw)
    return w, torch.randn(2, HEADS, DIM).to(BF16)


def _prefill(fi: ModuleType, t: dict[str, torch.Tensor], **kw: object) -> tuple[object, torch.Tensor]:
    w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(8, dtype=torch.uint8), "NHD")
    w.plan(t["qo"], t["indptr"], t["indices"], t["last"], HEADS, KV_HEADS, DIM, PAGE, causal=True,
           q_data_type=BF16, kv_data_type=BF16, **kw)
    return w, torch.randn(4, HEADS, DIM).to(BF16)


KINDS = [pytest.param(_decode, id="decode"), pytest.param(_prefill, id="prefill")]


def _fence() -> None:
    """What the backend does after plan, and before planning the same wrapper again."""
    done = torch.cpu.Event()
    done.record()
    done.synchronize()


@pytest.mark.parametrize("make", KINDS)
def test_run_refuses_a_q_or_kv_dtype_other_than_planned(fi: ModuleType, make: Callable) -> None:
    w, q = make(fi, _tables())
    k, v = _kv()
    with pytest.raises(ValueError, match="q_data_type"):
        w.run(q.half(), (k, v))
    with pytest.raises(ValueError, match="kv_data_type"):
        w.run(q, (k.half(), v.half()))
    assert w.run(q, (k, v)).dtype == BF16


@pytest.mark.parametrize("make,rows,says", [(_decode, 3, "batch size"), (_decode, 1, "batch size"),
                                            (_prefill, 5, r"qo_indptr\[-1\]"), (_prefill, 3, r"qo_indptr\[-1\]")])
def test_run_refuses_q_rows_that_disagree_with_the_plan(fi: ModuleType, make: Callable, rows: int, says: str) -> None:
    w, _ = make(fi, _tables())
    with pytest.raises(ValueError, match=says):
        w.run(torch.randn(rows, HEADS, DIM).to(BF16), _kv())


@pytest.mark.parametrize("make", KINDS)
@pytest.mark.parametrize("q_shape,kv_shape", [
    ((HEADS * 2, DIM), (PAGE, KV_HEADS, DIM)),  # q heads
    ((HEADS, 128), (PAGE, KV_HEADS, 128)),  # head_dim
    ((HEADS, DIM), (PAGE, KV_HEADS * 2, DIM)),  # KV heads
    ((HEADS, DIM), (PAGE * 2, KV_HEADS, DIM)),  # page size
], ids=["q-heads", "head-dim", "kv-heads", "page-size"])
def test_run_refuses_heads_head_dim_or_page_size_other_than_planned(fi: ModuleType, make: Callable, q_shape: tuple,
                                                                     kv_shape: tuple) -> None:
    w, q = make(fi, _tables())
    k = torch.zeros(8, *kv_shape, dtype=BF16)
    with pytest.raises(ValueError, match="plan"):
        w.run(torch.zeros(q.shape[0], *q_shape, dtype=BF16), (k, k.clone()))


@pytest.mark.parametrize("make", KINDS)
def test_run_reads_q_through_its_strides(fi: ModuleType, make: Callable) -> None:
    """q as the model hands it over, a view of wider qkv rows, gives what its copy gives; the
    prefill wrappers (FA3's TMA loads on Hopper) refuse strides that are not 16-byte multiples."""
    w, q = make(fi, _tables())
    kv = _kv()
    view = torch.cat([q.flatten(1), torch.randn(q.shape[0], 2 * KV_HEADS * DIM).to(BF16)], 1)[:, : HEADS * DIM]
    assert not view.is_contiguous() and torch.equal(w.run(view.view(q.shape), kv), w.run(q, kv))
    odd = torch.cat([q.flatten(1), torch.zeros(q.shape[0], 4, dtype=BF16)], 1)[:, : HEADS * DIM].view(q.shape)
    if make is _prefill:
        with pytest.raises(ValueError, match="TMA"):
            w.run(odd, kv)
    else:
        assert torch.equal(w.run(odd, kv), w.run(q, kv))


@pytest.mark.parametrize("make", KINDS)
@pytest.mark.parametrize("table", ["indptr", "indices", "last"])
def test_plan_refuses_index_tables_that_are_not_int32(fi: ModuleType, make: Callable, table: str) -> None:
    t = _tables()
    t[table] = t[table].long()
    with pytest.raises(ValueError, match="int32"):
        make(fi, t)


@pytest.mark.parametrize("make", KINDS)
def test_run_reads_the_callers_page_indices_by_reference(fi: ModuleType, make: Callable) -> None:
    """FlashInfer keeps the device tensors it is given: an overwrite between plan and run is
    what run reads."""
    t, kv = _tables(), _kv()
    w, q = make(fi, t)
    planned = w.run(q, kv)
    t["indices"].copy_(torch.tensor([1, 3, 0], dtype=I32))
    moved = w.run(q, kv)
    fresh, _ = make(fi, {**_tables(), "indices": torch.tensor([1, 3, 0], dtype=I32)})
    assert not torch.equal(moved, planned)
    assert torch.equal(moved, fresh.run(q, kv))


@pytest.mark.parametrize("make,table", [(_decode, "indptr"), (_decode, "last"), (_prefill, "indptr"),
                                        (_prefill, "last"), (_prefill, "qo")])
def test_host_inputs_changed_before_their_copy_landed_are_refused(fi: ModuleType, make: Callable, table: str) -> None:
    t = _tables()
    w, q = make(fi, t)
    t[table][1] -= 1
    with pytest.raises(RuntimeError, match="changed between plan"):
        w.run(q, _kv())
    with pytest.raises(RuntimeError, match="changed between plan"):
        _fence()  # the copy would carry the changed table too


@pytest.mark.parametrize("make", KINDS)
def test_host_inputs_are_the_callers_again_once_a_fence_after_plan_completed(fi: ModuleType, make: Callable) -> None:
    kv, before = _kv(), torch.cpu.Event()
    before.record()  # records nothing of the plan below: waiting on it lands nothing
    t = _tables()
    w, q = make(fi, t)
    planned = w.run(q, kv)
    before.synchronize()
    t["last"][0] = 4
    with pytest.raises(RuntimeError, match="changed"):
        w.run(q, kv)
    t["last"][0] = 2
    _fence()
    t["last"][0] = 4
    assert torch.equal(w.run(q, kv), planned)


@pytest.mark.parametrize("make", KINDS)
def test_replanning_a_wrapper_while_its_last_run_may_wait_for_the_copy_is_refused(fi: ModuleType,
                                                                                  make: Callable) -> None:
    w, q = make(fi, _tables())
    t = _tables()
    w.plan(*_plan_args(w, t), HEADS, KV_HEADS, DIM, PAGE, **_plan_kw(w))  # nothing ran: replaced
    w.run(q, _kv())
    with pytest.raises(RuntimeError, match="pinned plan buffer"):
        w.plan(*_plan_args(w, t), HEADS, KV_HEADS, DIM, PAGE, **_plan_kw(w))
    _fence()
    w.plan(*_plan_args(w, t), HEADS, KV_HEADS, DIM, PAGE, **_plan_kw(w))


def _plan_args(w: object, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    if isinstance(w, fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper):
        return t["indptr"], t["indices"], t["last"]
    return t["qo"], t["indptr"], t["indices"], t["last"]


def _plan_kw(w: object) -> dict[str, object]:
    kw: dict[str, object] = {"q_data_type": BF16, "kv_data_type": BF16}
    if isinstance(w, fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper):
        kw["causal"] = True
    return kw


def _backend_steps() -> Callable[[list[int]], torch.Tensor]:
    """The FlashInfer backend over two requests (6 and 11 tokens) in the pool: each call runs a
    decode step of the requests named, planning the decode wrapper again."""
    ctx = SimpleNamespace(
        req_to_token_pool=ReqToTokenPool(4, 64, "cpu"), kv_pool=TokenToKVPool(64 // PAGE + 1, PAGE, 1, KV_HEADS,
                                                                           DIM, BF16, "cpu"),
        device=torch.device("cpu"), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, scaling=DIM**-0.5,
        dtype=BF16, page_size=PAGE, config=RunnerConfig())
    backend = flashinfer_backend.FlashInferAttentionBackend(ctx)
    rows, lens, slots = ctx.req_to_token_pool.alloc(2), [6, 11], []
    for row, n in zip(rows, lens):
        slots.append(ctx.kv_pool.allocator.alloc(n))
        ctx.req_to_token_pool.write(row, 0, slots[-1])

    def step(which: list[int]) -> torch.Tensor:
        batch = ForwardBatch.build(
            ForwardMode.DECODE, [0] * len(which), [rows[i] for i in which], [lens[i] - 1 for i in which],
            [1] * len(which), torch.stack([slots[i][-1] for i in which]), "cpu")
        backend.init_forward_metadata(batch)
        k = torch.randn(len(which), KV_HEADS, DIM).to(BF16)
        return backend.forward(torch.randn(len(which), HEADS, DIM).to(BF16), k, k.clone(), 0, batch)

    return step


def test_the_backend_waits_for_each_plan_before_planning_its_wrapper_again(fi: ModuleType,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    step = _backend_steps()
    for which in ([0, 1], [1], [1, 0]):
        step(which)
    # The same backend with its wait made a no-op re-plans under a copy still in flight.
    monkeypatch.setattr(fake_flashinfer_copies.Fence, "synchronize", lambda self: None)
    with pytest.raises(RuntimeError, match="pinned plan buffer"):
        step([0])


def test_a_backend_that_refills_its_host_tables_in_place_is_caught(fi: ModuleType,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Host tables reused across steps (a pinned staging buffer, say) must wait for the previous
    plan's copy; the backend makes fresh ones, and one that does not is refused."""
    made = flashinfer_backend.host_page_counts
    held: list[torch.Tensor] = []

    def in_place(seq_lens: list[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        indptr, last = made(seq_lens, page_size)
        if not held:
            held.extend((indptr, last))
        held[0].copy_(indptr)
        held[1].copy_(last)
        return held[0], held[1]

    monkeypatch.setattr(flashinfer_backend, "host_page_counts", in_place)
    step = _backend_steps()
    step([0, 1])
    with pytest.raises(RuntimeError, match="changed between plan"):
        step([1, 0])  # refilled before the wait that precedes the plan
