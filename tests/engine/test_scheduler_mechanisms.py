"""Each seed mechanism on its own: budgets, policies, retraction, congestion
control, stop strings, aborts. Engine-level tests end with the pool whole."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.detokenizer import IncrementalDetokenizer, find_stop
from tandem.engine.engine_config import EngineConfig
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.radix_cache import create_prefix_cache
from tandem.engine.kvcache.req_table import ReqToTokenPool
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.engine.scheduler.decode_manager import DecodeManager
from tandem.engine.scheduler.prefill_adder import AddReqResult, PrefillAdder
from tandem.engine.scheduler.req import Req
from tandem.engine.scheduler.schedule_policy import LPM_FALLBACK_QUEUE_LEN, SchedulePolicy


def _cache(tokens: int = 256, page: int = 1, radix: bool = True) -> CacheManager:
    rt = ReqToTokenPool(32, 512, "cpu")
    kv = TokenToKVPool(tokens // page + 1, page, 1, 1, 4, torch.float32, "cpu")
    return CacheManager(rt, kv, create_prefix_cache(not radix, rt, kv.allocator, page))


def _req(rid: str, n: int, max_new: int = 16, out: int = 0, **kw) -> Req:
    r = Req(rid, list(range(10, 10 + n)), SamplingParams(max_new_tokens=max_new), **kw)
    r.output_ids = [1] * out
    return r


# ---- PrefillAdder budgets ----------------------------------------------------------------------
def test_rem_total_reserves_running_requests_by_new_token_ratio() -> None:
    cache = _cache(256)
    running = [_req("a", 10, max_new=100, out=20), _req("b", 10, max_new=5000)]
    adder = PrefillAdder(cache, running, new_token_ratio=0.5, max_prefill_tokens=1000, chunk_size=None,
                         clip_max_new_tokens=4096)
    # (100 - 20) * 0.5 + min(5000, CLIP=4096) * 0.5
    assert adder.reserved == pytest.approx(80 * 0.5 + 4096 * 0.5)
    assert adder.budget_state() == AddReqResult.NO_TOKEN


def test_input_budget_and_chunking_are_page_aligned() -> None:
    cache = _cache(1024, page=4)
    adder = PrefillAdder(cache, [], 0.5, max_prefill_tokens=64, chunk_size=30, clip_max_new_tokens=4096)
    big = _req("big", 100)
    big.init_next_round_input(cache.tree)
    assert adder.add_one_req(big) == AddReqResult.OTHER  # chunk budget spent
    assert adder.new_chunked_req is big and big.extend_input_len == 28  # 30 rounded down to pages
    small = _req("small", 5)
    small.init_next_round_input(cache.tree)
    assert adder.add_one_req(small) == AddReqResult.OTHER  # nothing left this round
    assert adder.can_run_list == [big]


def test_first_request_may_exceed_input_budget_but_not_the_second() -> None:
    cache = _cache(1024)
    adder = PrefillAdder(cache, [], 0.5, max_prefill_tokens=10, chunk_size=None, clip_max_new_tokens=4096)
    a, b = _req("a", 40), _req("b", 3)
    for r in (a, b):
        r.init_next_round_input(cache.tree)
    adder.add_one_req(a)
    assert adder.add_one_req(b) == AddReqResult.OTHER and adder.can_run_list == [a]


def test_kv_budget_counts_outputs_still_to_come() -> None:
    cache = _cache(64)
    adder = PrefillAdder(cache, [], 0.5, max_prefill_tokens=1000, chunk_size=None, clip_max_new_tokens=4096)
    r = _req("a", 20, max_new=50)  # 20 + 50 > 64
    r.init_next_round_input(cache.tree)
    assert adder.add_one_req(r) == AddReqResult.NO_TOKEN and not adder.can_run_list


# ---- policies -----------------------------------------------------------------------------------
def test_lpm_orders_by_cached_prefix_and_falls_back_to_fcfs() -> None:
    cache = _cache(512)
    slots = cache.allocator.alloc(32)
    cache.tree.insert(list(range(10, 42)), slots)
    policy = SchedulePolicy("lpm", cache.tree, enable_priority=False)
    miss = Req("miss", [7] * 40, SamplingParams())
    hit = Req("hit", list(range(10, 50)), SamplingParams())
    queue = [miss, hit]
    policy.calc_priority(queue)
    assert [r.rid for r in queue] == ["hit", "miss"]
    assert policy.effective_policy(LPM_FALLBACK_QUEUE_LEN + 1) == "fcfs"
    assert policy.effective_policy(LPM_FALLBACK_QUEUE_LEN) == "lpm"


def test_in_batch_prefix_caching_deprioritises_followers() -> None:
    cache = _cache(512)
    policy = SchedulePolicy("lpm", cache.tree, enable_priority=False)
    shared = list(range(100, 140))  # 40 shared tokens > DEPRIORITIZE_THRESHOLD (32)
    first = Req("first", shared + [1, 2], SamplingParams())
    follower = Req("follower", shared + [3, 4], SamplingParams())
    short = Req("short", shared[:10] + [5], SamplingParams())  # shares too little to wait
    queue = [first, follower, short]
    deprioritized = policy.calc_priority(queue)
    assert deprioritized == {"follower"}
    assert queue[-1].rid == "follower"


@pytest.mark.parametrize("policy,expected", [
    ("fcfs", ["a", "b", "c"]), ("lof", ["c", "b", "a"]),
])
def test_cache_agnostic_policies(policy: str, expected: list[str]) -> None:
    reqs = [Req(n, [1, 2], SamplingParams(max_new_tokens=m)) for n, m in (("a", 1), ("b", 5), ("c", 9))]
    SchedulePolicy(policy, _cache().tree, enable_priority=False).calc_priority(reqs)
    assert [r.rid for r in reqs] == expected


def test_priority_is_the_primary_key() -> None:
    reqs = [Req("low", [1], SamplingParams(), priority=0), Req("high", [1], SamplingParams(), priority=5)]
    SchedulePolicy("fcfs", _cache().tree, enable_priority=True).calc_priority(reqs)
    assert reqs[0].rid == "high"


def test_dfs_weight_groups_requests_under_the_heaviest_subtree() -> None:
    cache = _cache(512)
    for base in (100, 300):
        cache.tree.insert(list(range(base, base + 16)), cache.allocator.alloc(16))
    reqs = [Req("x1", list(range(100, 120)), SamplingParams()),
            Req("y1", list(range(300, 320)), SamplingParams()),
            Req("y2", list(range(300, 316)) + [1, 2], SamplingParams())]
    SchedulePolicy("dfs-weight", cache.tree, enable_priority=False).calc_priority(reqs)
    assert [r.rid for r in reqs][:2] == ["y1", "y2"]


# ---- retraction and new_token_ratio -----------------------------------------------------------------
def test_retract_order_fewest_outputs_then_longest_input() -> None:
    dm = DecodeManager(EngineConfig(), _cache())
    reqs = [_req("many-out", 5, out=9), _req("few-out-short", 5, out=1), _req("few-out-long", 50, out=1)]
    assert [r.rid for r in dm.retract_order(reqs)] == ["few-out-long", "few-out-short", "many-out"]


def test_new_token_ratio_decays_to_min_and_resets_on_retraction() -> None:
    cfg = EngineConfig(init_new_token_ratio=0.7, min_new_token_ratio_factor=0.2, new_token_ratio_decay_steps=10)
    dm = DecodeManager(cfg, _cache())
    assert dm.new_token_ratio == pytest.approx(0.7)
    assert dm.min_new_token_ratio == pytest.approx(0.14)
    for _ in range(30):
        dm.new_token_ratio = max(dm.new_token_ratio - dm.new_token_ratio_decay, dm.min_new_token_ratio)
    assert dm.new_token_ratio == pytest.approx(0.14)


# ---- stop strings -------------------------------------------------------------------------------
def test_stop_string_split_across_tokens_is_found(model_path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path("tiny")))
    ids = tok.encode("alpha beta STOPHERE gamma")
    detok = IncrementalDetokenizer(tok)
    hit = None
    for i in ids:  # one token at a time: "STOPHERE" spans several tokens
        delta = detok.step([i])
        hit = hit or (find_stop(detok.text, len(delta), ("STOPHERE",)) if delta else None)
    assert hit is not None and detok.text[: hit[0]] == "alpha beta "
    assert len(tok.encode("STOPHERE")) > 1


def test_engine_stops_on_stop_string_and_trims_it(engine) -> None:
    eng = engine(max_total_tokens=2048)
    free = eng.generate([[5, 6, 7, 8]], {"max_new_tokens": 24, "temperature": 0})[0]
    text = free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # three characters from the middle
    out = eng.generate([[5, 6, 7, 8]], {"max_new_tokens": 24, "temperature": 0, "stop": [stop]})[0]
    assert out["finish_reason"] == "stop" and out["meta"]["matched_stop"] == stop
    assert stop not in out["text"] and text.startswith(out["text"])
    chunks = list(eng.generate_stream([5, 6, 7, 8], {"max_new_tokens": 24, "temperature": 0, "stop": stop}))
    assert "".join(c["text"] for c in chunks) == out["text"]


def test_bad_requests_get_clear_errors(engine) -> None:
    eng = engine(max_total_tokens=512)
    vocab = eng.tokenizer.vocab_size
    cases = [([vocab + 5], {}), ([1, 2], {"temperature": -1}), ([1] * 400, {"max_new_tokens": 200})]
    for ids, sp in cases:
        out = eng.generate([ids], sp)[0]
        assert out["finish_reason"] == "abort" and out["meta"]["finish_message"]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_priority_preempts_lower_priority_running_requests(engine, overlap: bool) -> None:
    eng = engine(max_total_tokens=4096, max_running_requests=2, enable_priority_scheduling=True,
                 priority_scheduling_preemption_threshold=1, disable_overlap_schedule=not overlap)
    # 600 tokens: both low-priority requests are still decoding when the high one arrives.
    long = {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True}
    low = [eng.submit([1, 2, 3, i], long, priority=0) for i in range(2)]
    assert not any(h.next(timeout=60).finished for h in low)  # each has its first token: both decode
    high = eng.submit([4, 5, 6], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}, priority=5)
    assert high.result(timeout=60)[1].completion_tokens == 4
    lows = [h.result(timeout=120)[1] for h in low]
    assert all(o.completion_tokens == 600 for o in lows)
    assert sum(o.retract_count for o in lows) >= 1, "no running request was preempted"


def test_dp_budget_dispatch_methods() -> None:
    from tandem.engine.dp_controller import DPBudget
    from tandem.protocol.messages import GenerateReq

    msg = lambda room=None: GenerateReq("r", [1], bootstrap_room=room)  # noqa: E731
    b = DPBudget(3)
    assert [b.dispatch("round_robin", msg()) for _ in range(4)] == [0, 1, 2, 0]
    b.add(0, 100)
    b.add(1, 10)
    assert b.dispatch("total_requests", msg()) == 2
    b.add(2, 50)
    assert b.dispatch("total_tokens", msg()) == 1
    b.remove(0, 100)
    assert b.dispatch("total_tokens", msg()) == 0
    assert b.dispatch("follow_bootstrap_room", msg(room=7)) == 1
    with pytest.raises(ValueError):
        b.dispatch("follow_bootstrap_room", msg())


def test_step_metrics_track_load(engine) -> None:
    eng = engine(max_total_tokens=2048)
    eng.generate([[1, 2, 3]] * 4, {"max_new_tokens": 8, "temperature": 0})
    reply = eng.status()[0]
    assert reply.ok and reply.info["idle"], reply.info
    m = reply.info["metrics"]
    assert m["peak_running"] == 4 and 0 < m["peak_kv_usage"] < 1
    assert m["ttft_mean"] > 0 and m["tpot_mean"] > 0 and m["decode_batches"] >= 7


def test_overlap_defaults_on_for_cuda_off_for_cpu() -> None:
    assert EngineConfig(device="cuda").enable_overlap
    assert not EngineConfig(device="cpu").enable_overlap
    assert EngineConfig(device="cpu", disable_overlap_schedule=False).enable_overlap
    assert not EngineConfig(device="cuda", disable_overlap_schedule=True).enable_overlap
