"""The GPU path's host side, tested on CPU: KV-pool sizing, the prefill chunk default, the
stream hand-off between the scheduler and the forward thread, and the host mirror of the
request-row table that keeps the scheduler from reading GPU memory every step.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from engine_checks import assert_whole

from tandem.engine.engine_config import EngineConfig, default_chunked_prefill_size
from tandem.engine.kvcache.kv_memory import kv_budget_bytes, reserve_bytes
from tandem.engine.model_config import ModelConfig, RunnerConfig
from tandem.engine.runner.model_worker import OverlapWorker

BF16 = torch.bfloat16


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
    assert reserve_bytes(mc, big, BF16, cpu, 1024) > reserve_bytes(mc, small, BF16, cpu, 1024) > 0
    assert reserve_bytes(mc, big, BF16, cuda, 1024) - reserve_bytes(mc, big, BF16, cpu, 1024) == GIB
    chunked = EngineConfig(chunked_prefill_size=4096, max_prefill_tokens=2048)
    assert chunked.runner_config().max_forward_tokens == 4096


def test_reserve_counts_the_row_table_and_what_graphs_hold(model_path, monkeypatch) -> None:
    """Both are allocated after the pool is sized. The row table is 2 x max_running_requests
    rows of max_context_len int32; the graphs' bytes (runner/graph_memory.py) are reserved
    exactly when the runner will capture graphs, and the pool shrinks by them."""
    from tandem.engine.kvcache import kv_memory
    from tandem.engine.runner.graph_memory import graph_memory
    from tandem.engine.runner.model_runner import ModelRunner

    mc = ModelConfig.from_pretrained(model_path("tiny"))
    cfg = RunnerConfig(max_running_requests=64, max_forward_tokens=512)
    cuda = torch.device("cuda")
    assert reserve_bytes(mc, cfg, BF16, cuda, 4096) - reserve_bytes(mc, cfg, BF16, cuda, 1024) == 2 * 64 * 3072 * 4
    graphs = graph_memory(mc, cfg, BF16, 1024).total
    with_graphs = reserve_bytes(mc, cfg, BF16, cuda, 1024, graphs)
    assert graphs > 0 and with_graphs - reserve_bytes(mc, cfg, BF16, cuda, 1024) == graphs

    runner = ModelRunner(model_path("tiny"), RunnerConfig(dtype="bfloat16", device="cpu", max_running_requests=8,
                                                          max_forward_tokens=64, max_context_len=256))
    per_token = mc.num_layers * 2 * mc.kv_size * 2
    graphs = graph_memory(mc, runner.config, BF16, 256).total
    spare = 1000 * per_token
    free = reserve_bytes(mc, runner.config, BF16, runner.device, 256) + graphs + spare
    monkeypatch.setattr(kv_memory, "device_memory", lambda device: (1 << 50, free))
    sized = {}
    for on in (False, True):
        monkeypatch.setattr(ModelRunner, "plans_cuda_graphs", lambda self, on=on: on)
        sized[on] = runner.size_kv_memory().kv_pool.capacity_tokens
    assert (sized[False], sized[True]) == ((graphs + spare) // per_token, 1000)


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

    future_map = SimpleNamespace(alloc=lambda n: range(1, n + 1), ids=lambda s: -torch.arange(s.start, s.stop))
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
def test_scheduler_on_a_mirrored_row_table_matches_and_keeps_the_mirror_exact(engine, monkeypatch) -> None:
    """Off the CPU the request-row table has a host mirror the scheduler reads (a request's last
    slot each decode step, its slots when it finishes or is cached), so no step waits on the
    GPU. Forced on here: same tokens as the plain table, through prefix hits, chunked prefill
    and overlap, and flush's integrity check finds the mirror equal to the table."""
    import functools

    from tandem.engine.kvcache import kv_memory
    from tandem.engine.kvcache.req_table import ReqToTokenPool

    g = torch.Generator().manual_seed(7)
    shared = torch.randint(10, 8000, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(10, 8000, (n,), generator=g).tolist() for n in (5, 70, 12, 33)]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (9, 3, 17, 6)]
    kw = dict(device="cpu", dtype="float32", page_size=4, chunked_prefill_size=32, max_total_tokens=2048,
              disable_overlap_schedule=False)

    def run() -> tuple[list[list[int]], bool]:
        eng = engine(**kw)
        out = [r["token_ids"] for r in eng.generate(prompts[:1], params[:1])]  # cached, then hit
        out += [r["token_ids"] for r in eng.generate(prompts[1:], params[1:])]
        assert_whole(eng)  # the check compares the mirror with the table
        table = eng.scheduler.runner.req_to_token_pool
        return out, table.host is not table.req_to_token

    plain, mirrored = run()
    assert not mirrored
    monkeypatch.setattr(kv_memory, "ReqToTokenPool", functools.partial(ReqToTokenPool, host_mirror=True))
    assert run() == (plain, True)


def test_mirror_check_covers_a_big_table_in_turns() -> None:
    """A GPU table can be hundreds of MB: each idle check compares 8 rows in turn, and so
    finds a divergence within size / 8 checks."""
    from tandem.engine.kvcache.req_table import ReqToTokenPool

    pool = ReqToTokenPool(20, 16, "cpu", host_mirror=True)
    pool.write(3, 0, torch.arange(5))
    rows, cols, slots = np.array([3, 4]), np.array([5, 0]), np.array([7, 8])
    pool.write_decode_cells(rows, cols, slots)  # the host's copy; the forward writes the device's
    pool.req_to_token[torch.from_numpy(rows), torch.from_numpy(cols)] = torch.tensor([7, 8], dtype=torch.int32)
    for _ in range(3):
        pool._check_mirror(max_bytes=0)
    pool.req_to_token[17, 2] = 9  # a write that bypassed the mirror
    with pytest.raises(AssertionError, match="mirror"):
        for _ in range(3):
            pool._check_mirror(max_bytes=0)
    with pytest.raises(AssertionError, match="mirror"):
        pool.check_integrity()  # small: the whole table at once


def test_a_discarded_row_is_synced_from_the_mirror() -> None:
    """The forward writes a decode step's table cells on the device; a step that failed before
    writing them leaves the device behind the mirror. Discarding the failed request's row copies
    the mirror's row over, so the idle integrity check still finds them equal."""
    from tandem.engine.kvcache.req_table import ReqToTokenPool

    pool = ReqToTokenPool(4, 16, "cpu", host_mirror=True)
    pool.write(2, 0, torch.arange(5))
    pool.write_decode_cells(np.array([2]), np.array([5]), np.array([9]))  # its forward never ran
    with pytest.raises(AssertionError, match="mirror"):
        pool.check_integrity()
    pool.sync_rows([2])
    pool.check_integrity()


def test_future_ids_are_stored_as_a_slice_without_moving_the_indices() -> None:
    """Indexing the ring with the slots would copy them to the device with a sync: on a GPU the
    forward thread waited there for its whole step (1.1 ms of a 2.3 ms step on the H200)."""
    from tandem.engine.runner.future_map import FutureMap

    fm = FutureMap(2, "cpu")  # ring of 9: slots 1..8
    fm.alloc(7)
    slots = fm.alloc(3)  # wraps around to 1..3
    assert slots == range(1, 4) and fm.ids(slots).tolist() == [-1, -2, -3]
    fm.store(slots, torch.tensor([7, 8, 9]))
    assert fm.resolve(torch.tensor([5, -3, -1, -2])).tolist() == [5, 9, 7, 8]
