"""Tensor parallelism on CPU (gloo): TP=2 and TP=4 give TP=1's greedy tokens, in both loops,
with the radix cache, chunked prefill, retraction and constrained decoding; each rank loads only
its shard; the ranks' pools are whole afterwards (each rank's, gathered by the flush).

The model tests start their ranks as spawned processes that meet on a free loopback port."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from smoke import full_only

from tandem.engine.model_config import ModelConfig, RunnerConfig
from tandem.engine.models.loader import load_model
from tandem.engine.parallel.digest import RanksDiverged, batch_digest, check_same_batch
from tandem.engine.parallel.group import TPGroup
from tandem.engine.parallel.shard import plan_shard, tp_problems
from tandem.engine.parallel.tick import Tick
from tandem.local.plan import free_port
from tandem.protocol.messages import AbortReq, GenerateReq, ShutdownReq
from tandem.worker_contract import tp_head_problem

PROMPTS = [[1, 5, 9, 13, 22, 40], [3, 4, 5] * 7, [7] * 20, [1, 5, 9, 13, 22, 41, 2, 2]]
GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
# fp32 all-reduces sum in another order than one rank's matmul: logits move by ~1e-5.
LOGIT_ATOL = 2e-4


# ---- the split ---------------------------------------------------------------------------------
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 8), st.integers(1, 3))
def test_every_q_head_lands_with_its_kv_head(tp: int, kv: int, group: int, inter: int) -> None:
    """Rank r's q heads attend to exactly the KV heads it holds (GQA: head j reads kv head
    j // group), the ranks cover every head and MLP feature once, the vocab rows tile."""
    heads, intermediate, vocab = kv * group, 64 * inter, 1000
    if tp_problems(tp, heads, kv, intermediate):
        with pytest.raises(ValueError):
            plan_shard(0, tp, heads, kv, intermediate, vocab)
        return
    shards = [plan_shard(r, tp, heads, kv, intermediate, vocab) for r in range(tp)]
    assert [h for s in shards for h in range(*s.q_heads)] == list(range(heads))
    assert [i for s in shards for i in range(*s.intermediate)] == list(range(intermediate))
    assert shards[0].vocab[0] == 0 and shards[-1].vocab[1] >= vocab
    assert all(a.vocab[1] == b.vocab[0] for a, b in zip(shards, shards[1:]))
    for s in shards:
        assert {j // group for j in range(*s.q_heads)} <= set(range(*s.kv_heads))
    assert {h for s in shards for h in range(*s.kv_heads)} == set(range(kv))


def test_sizes_the_heads_refuse() -> None:
    assert tp_problems(3, 12, 4, 96) == [tp_head_problem(3, 12, 4)]
    assert "KV heads can be neither split across the ranks nor replicated" in tp_problems(3, 12, 4, 96)[0]
    assert tp_problems(2, 12, 4, 97) == ["tp_size 2 does not divide the model's MLP size 97"]
    assert "attention heads" in tp_problems(8, 12, 4, 96)[0]
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        ModelConfig.from_pretrained(_tiny()).for_rank(0, 8)


def _tiny() -> Path:
    from tandem.engine.modelgen.resolve import resolve_model

    return resolve_model("tiny")


@pytest.mark.parametrize("preset,tp", [("tiny", 2), ("tiny-llama", 4), ("tiny-qwen2", 2)])
def test_each_rank_loads_only_its_shard_and_the_shards_make_the_model(model_path, preset: str, tp: int) -> None:
    """Loaded with no process group: the shards, put back together along the split, are the
    whole model's weights (the vocab padding zero)."""
    full_cfg = ModelConfig.from_pretrained(model_path(preset))
    full = dict(load_model(full_cfg, torch.float32, torch.device("cpu"), 64).named_parameters())
    parts = [dict(load_model(full_cfg.for_rank(r, tp), torch.float32, torch.device("cpu"), 64).named_parameters())
             for r in range(tp)]
    V, d = full_cfg.vocab_size, full_cfg.head_dim
    q, kv = full_cfg.q_size, full_cfg.kv_size
    for name, w in full.items():
        got = [p[name] for p in parts]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.testing.assert_close(torch.cat(got, 1), w, rtol=0, atol=0)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            whole = torch.cat(got, 0)
            torch.testing.assert_close(whole[:V], w, rtol=0, atol=0)
            assert not whole[V:].any()
        elif "qkv_proj" in name:
            shards = [full_cfg.for_rank(r, tp).shard for r in range(tp)]
            for s, g in zip(shards, got):
                lq, lk = s.num_heads * d, s.num_kv_heads * d
                k0, k1 = s.kv_heads[0] * d, s.kv_heads[1] * d
                assert torch.equal(g[:lq], w[s.q_heads[0] * d: s.q_heads[1] * d])
                assert torch.equal(g[lq: lq + lk], w[q + k0: q + k1])
                assert torch.equal(g[lq + lk:], w[q + kv + k0: q + kv + k1])
        elif "gate_up" in name:
            inter = full_cfg.intermediate_size
            gates = torch.cat([g[: g.shape[0] // 2] for g in got])
            ups = torch.cat([g[g.shape[0] // 2:] for g in got])
            torch.testing.assert_close(torch.cat([gates, ups]), w, rtol=0, atol=0)
            assert gates.shape[0] == inter
        else:  # norms: whole on every rank
            for g in got:
                torch.testing.assert_close(g, w, rtol=0, atol=0)


# ---- the model over a real gloo group ---------------------------------------------------------------
def _rank_logits(rank: int, size: int, addr: str, path: str, out: Any) -> None:
    from tandem.engine.runner.model_runner import ModelRunner
    from tandem.engine.runner.static_generate import StaticBatch

    torch.set_num_threads(1)
    tp = TPGroup.init(rank, size, addr, torch.device("cpu"))
    try:
        cfg = RunnerConfig(dtype="float32", device="cpu", max_total_tokens=1024, max_running_requests=8)
        runner = ModelRunner(path, cfg, tp)
        runner.attach(runner.size_kv_memory())
        sb = StaticBatch(runner)
        logits = sb.forward(sb.new(len(PROMPTS)), PROMPTS)
        if rank == 0:
            out.put(logits.numpy().tolist())
    finally:
        tp.close()


def _logits(path: Path, size: int) -> torch.Tensor:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_logits, args=(r, size, addr, str(path), out), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    try:
        return torch.tensor(out.get(timeout=240))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("preset,tp", [("tiny", 2), pytest.param("tiny", 4, marks=full_only("tiny at tp=2")),
                                       pytest.param("tiny-llama-d256", 2, marks=full_only("tiny at tp=2"))])
def test_tp_logits_match_one_rank(model_path, preset: str, tp: int) -> None:
    """tiny at TP=4 replicates its 2 KV heads; tiny-llama-d256 splits 2 KV heads under 16 q heads."""
    one = _logits(model_path(preset), 1)
    many = _logits(model_path(preset), tp)
    torch.testing.assert_close(many, one, rtol=0, atol=LOGIT_ATOL)
    assert torch.equal(many.argmax(-1), one.argmax(-1))


# ---- the scheduler, once per rank -------------------------------------------------------------------
MODES = {
    "normal": {"disable_overlap_schedule": True},
    "overlap": {"disable_overlap_schedule": False},
    "overlap-paged-chunked": {"disable_overlap_schedule": False, "page_size": 4, "chunked_prefill_size": 8},
    "normal-lpm-retract": {"disable_overlap_schedule": True, "max_total_tokens": 64, "schedule_policy": "lpm"},
}


@pytest.fixture(scope="module")
def tp1_tokens(model_path) -> dict[str, list[list[int]]]:
    from tandem import Engine

    out = {}
    for mode, kw in MODES.items():
        with Engine(str(model_path("tiny")), dtype="float32", **{"max_total_tokens": 4096, **kw}) as eng:
            out[mode] = [o["token_ids"] for o in eng.generate(PROMPTS * 2, GREEDY)]
    return out


# The smoke form keeps the two modes that cover the others' paths: overlap with pages and chunks,
# and the normal loop with lpm and retraction.
_SMOKE_MODES = "overlap-paged-chunked, normal-lpm-retract"


@pytest.mark.parametrize("mode", [m if "-" in m else pytest.param(m, marks=full_only(_SMOKE_MODES)) for m in MODES])
def test_tp2_engine_gives_tp1_tokens(engine, tp1_tokens, mode: str) -> None:
    """Twice the prompts: the second copy hits the radix cache that the first filled."""
    eng = engine("tiny", tp_size=2, debug_tp_digest=True, **{"max_total_tokens": 4096, **MODES[mode]})
    assert [o["token_ids"] for o in eng.generate(PROMPTS * 2, GREEDY)] == tp1_tokens[mode]
    pools = eng.flush_cache()[0].info["tp_ranks"]
    assert len(pools) == 2 and all(p["free_tokens"] == p["capacity_tokens"] for p in pools), pools


def test_tp2_constrained_decoding_and_aborts(engine, model_path) -> None:
    """Grammars compile on every rank, at different moments: rank 0 says when each is ready."""
    from tandem import Engine

    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    sp = [{"max_new_tokens": 24, "temperature": 0.0, "json_schema": schema}, {**GREEDY, "temperature": 0.7, "seed": 3}]
    with Engine(str(model_path("tiny")), dtype="float32", max_total_tokens=4096) as one:
        want = [o["token_ids"] for o in one.generate(PROMPTS[:2], sp)]
    eng = engine("tiny", tp_size=2, debug_tp_digest=True, max_total_tokens=4096)
    assert [o["token_ids"] for o in eng.generate(PROMPTS[:2], sp)] == want
    handle = eng.submit(PROMPTS[2], {**GREEDY, "max_new_tokens": 4000, "ignore_eos": True})
    eng.abort(handle.rid)
    assert handle.result(timeout=60)[1].finish_reason["kind"] == "abort"


# ---- the pieces that keep ranks in step ---------------------------------------------------------------
def test_a_tick_round_trips_and_carries_no_pickle() -> None:
    tick = Tick(12.5, [GenerateReq("a", [1, 2], {"max_new_tokens": 3}), AbortReq("b"), ShutdownReq()],
                [("c", None, 0), ("d", "too slow", 400)], [("e", "too costly")])
    back = Tick.decode(tick.encode())
    assert back == tick
    with pytest.raises(ValueError, match="tick version"):
        Tick.decode(json.dumps({"v": 0, "now": 0, "msgs": [], "grammar": []}).encode())


class _FakeGroup(TPGroup):
    def __init__(self, others: list[int]) -> None:
        super().__init__(0, 1 + len(others), None, None)
        self.others = others

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return [values, *[[o] for o in self.others]]


def test_the_digest_stops_ranks_that_diverge() -> None:
    from tandem.engine.forward_batch import ForwardMode
    from tandem.engine.worker_batch import ModelWorkerBatch

    mwb = ModelWorkerBatch(ForwardMode.DECODE, np.array([5, 6]), [1, 2], [3, 4], [1, 1], np.array([9, 10]),
                           0, [], [0, 0], False)
    d = batch_digest(mwb)
    check_same_batch(_FakeGroup([d]), mwb, 1)
    mwb.out_cache_loc = np.array([9, 11])
    assert batch_digest(mwb) != d
    with pytest.raises(RanksDiverged, match="step 7"):
        check_same_batch(_FakeGroup([d]), mwb, 7)


def test_dp2_x_tp2_gives_tp1_tokens(engine, tp1_tokens) -> None:
    """Four processes: two replicas of two ranks each, requests spread round-robin."""
    eng = engine("tiny", dp_size=2, tp_size=2, debug_tp_digest=True, max_total_tokens=4096,
                 disable_overlap_schedule=True)
    assert [o["token_ids"] for o in eng.generate(PROMPTS * 2, GREEDY)] == tp1_tokens["normal"]
    assert [len(r.info["tp_ranks"]) for r in eng.flush_cache()] == [2, 2]


def test_a_dead_rank_fails_the_engine_at_once(model_path) -> None:
    """A follower killed: rank 0's next broadcast fails (gloo sees the closed pair), it reports
    why and exits; requests then fail with that reason instead of hanging."""
    from waits import wait_until

    from tandem import Engine

    eng = Engine(str(model_path("tiny")), tp_size=2, dtype="float32", max_total_tokens=4096)
    try:
        assert eng.generate([[1, 2, 3]], {"max_new_tokens": 2, "temperature": 0})
        eng._backend.procs[1].kill()
        wait_until(lambda: eng.error is not None, 60, "the engine to see the dead rank")
        assert "rank 0.tp0 failed" in str(eng.error) or "exited" in str(eng.error)
        with pytest.raises(RuntimeError, match="scheduler"):
            eng.generate([[1, 2, 3]], {"max_new_tokens": 2, "temperature": 0})
    finally:
        eng.shutdown()
