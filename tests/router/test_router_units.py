"""The router's parts without servers: policies (cache_aware never spirals into the smallest
tree), the prefix index, the circuit breaker (4xx never counts), admission (bounded FIFO,
429), the tokenizer (the workers' ids), and the torch-free import."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
from tandem.router.admission import Admission  # noqa: E402
from tandem.router.policies import CacheAware, make_policy  # noqa: E402
from tandem.router.policies.load import RoundRobin  # noqa: E402
from tandem.router.prefix_index import PrefixIndex, block_names  # noqa: E402
from tandem.router.workers import Breaker, Worker  # noqa: E402
from tandem.web.errors import ApiError  # noqa: E402


def _pool(n: int = 4) -> list[Worker]:
    return [Worker(f"http://w{i}") for i in range(n)]


def test_prefix_index_matches_prefixes_and_forgets_lru() -> None:
    idx = PrefixIndex(block=4, capacity=6)
    a, b = list(range(16)), list(range(8)) + [99] * 8
    idx.insert("w", block_names(a, 4))
    assert idx.match("w", block_names(a, 4)) == 4
    assert idx.match("w", block_names(b, 4)) == 2  # shares the first two blocks
    assert idx.match("x", block_names(a, 4)) == 0
    idx.insert("w", block_names([7] * 12, 4))  # 3 more blocks: the oldest fall out
    assert idx.size("w") == 6 and idx.match("w", block_names(a, 4)) < 4


def test_cache_aware_follows_the_prefix_and_misses_by_load() -> None:
    pool = _pool()
    pol = CacheAware(PrefixIndex(block=4), threshold=0.5)
    prompt = list(range(64))
    first, _ = pol.pick(pool, prompt)
    again, matched = pol.pick(pool, prompt + [1, 2, 3])
    assert again is first and matched == 64
    # A miss goes by load. The worker with the smallest tree (nothing cached) is not
    # preferred for being small: it is picked only if it is also the least loaded.
    for w, load in zip(pool, (5, 0, 3, 3)):
        w.tokens = load
    fresh, matched = pol.pick(pool, [500 + i for i in range(64)])
    assert fresh is pool[1] and matched == 0


def test_cache_aware_ignores_a_hit_when_load_is_imbalanced() -> None:
    pool = _pool(2)
    pol = CacheAware(PrefixIndex(block=4), threshold=0.1, balance=1.3, balance_abs=4)
    prompt = list(range(32))
    hot, _ = pol.pick(pool, prompt)
    hot.requests, hot.tokens = 10, 1000
    other = next(w for w in pool if w is not hot)
    assert pol.pick(pool, prompt)[0] is other  # the hit is on an overloaded worker


@pytest.mark.parametrize("name", ["round_robin", "random", "least_requests", "least_tokens", "power_of_two"])
def test_every_policy_spreads_over_idle_workers(name) -> None:
    pool = _pool()
    pol = make_policy(name, seed=0)
    picked = set()
    for i in range(40):
        w, _ = pol.pick(pool, [i])
        picked.add(w.url)
        w.requests += 1
        w.tokens += 1
    assert len(picked) == 4


def test_breaker_opens_on_faults_only_and_half_opens() -> None:
    now = [0.0]
    b = Breaker(threshold=3, cooldown=10.0, clock=lambda: now[0])
    for _ in range(2):
        b.on_fault()
    b.on_success()  # a success (any status under 500, 4xx included) resets the count
    for _ in range(3):
        assert b.allows()
        b.on_fault()
    assert b.state == "open" and not b.allows()
    now[0] = 9.9
    assert b.state == "open"
    now[0] = 10.0
    assert b.state == "half_open" and b.allows()
    b.on_dispatch()
    assert not b.allows()  # one trial at a time
    b.on_success()
    assert b.state == "closed"


def test_admission_queues_in_order_and_refuses_past_its_bounds() -> None:
    async def main() -> None:
        adm = Admission(max_inflight=1, max_queue=2, queue_timeout=0.3)
        order: list[int] = []

        async def req(i: int, hold: float) -> None:
            async with adm.slot():
                order.append(i)
                await asyncio.sleep(hold)  # sleep-ok: a request holding its slot

        first = asyncio.create_task(req(0, 0.1))
        await asyncio.sleep(0.01)  # sleep-ok: the tasks started so far take their places in line
        waiting = [asyncio.create_task(req(i, 0.01)) for i in (1, 2)]
        await asyncio.sleep(0.01)  # sleep-ok: the tasks started so far take their places in line
        with pytest.raises(ApiError) as full:
            await req(3, 0)
        assert full.value.status == 429
        await asyncio.gather(first, *waiting)
        assert order == [0, 1, 2] and adm.inflight == 0
        slow = asyncio.create_task(req(4, 0.5))
        await asyncio.sleep(0.01)  # sleep-ok: the tasks started so far take their places in line
        with pytest.raises(ApiError, match="waited"):
            await req(5, 0)
        await slow

    asyncio.run(main())


def test_admission_counts_a_requests_sequences_up_to_a_quarter_of_the_slots() -> None:
    """One request took one slot whatever its prompts x n: a batch could fill every worker."""

    async def main() -> None:
        adm = Admission(max_inflight=8, max_queue=4, queue_timeout=5)
        with pytest.raises(ApiError) as big:
            await adm.acquire(3)
        assert big.value.status == 400 and adm.slots == 0
        for _ in range(4):
            await adm.acquire(2)
        assert (adm.inflight, adm.slots) == (4, 8)
        waiting = asyncio.create_task(adm.acquire(2))
        await asyncio.sleep(0.01)  # sleep-ok: the task takes its place in line
        adm.release(1)  # a request of one sequence (as far as the slots go) ends
        await asyncio.sleep(0.01)  # sleep-ok: one free slot is not enough for it
        assert not waiting.done()
        adm.release(1)
        await asyncio.wait_for(waiting, 5)
        assert (adm.inflight, adm.slots) == (3, 8)

    asyncio.run(main())


def test_tokenizer_gives_the_workers_ids(model_path) -> None:
    from transformers import AutoTokenizer

    from tandem.router.tokenizer import RouterTokenizer

    model = str(model_path("tiny"))
    ours, hf = RouterTokenizer(model), AutoTokenizer.from_pretrained(model)
    for text in ("hello world", "  spaces\tand\nlines ", "ünïcödé ✓"):
        assert ours.encode(text) == list(hf.encode(text))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ours.chat(msgs) == list(hf.encode(text, add_special_tokens=False))


def test_tokenizer_renders_templates_as_transformers(model_path, tmp_path) -> None:
    """The parts of transformers' template environment real templates use: {% break %} (Qwen),
    strftime_now (Llama 3.x), and a tojson that leaves '<' and non-ASCII alone (tool schemas)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from tandem.router.tokenizer import RouterTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path("tiny") / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{{ strftime_now('%Y') }}{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
        "{{ m.role }}: {{ m.content | tojson }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    msgs = [{"role": "user", "content": "<b>café</b> & 你好"}, {"role": "stop", "content": "x"},
            {"role": "user", "content": "never rendered"}]
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    text = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert "<b>café</b> & 你好" in text and "never" not in text
    assert RouterTokenizer(str(tmp_path)).chat(msgs) == list(hf.encode(text, add_special_tokens=False))


def test_router_never_imports_torch() -> None:
    code = ("import sys; import tandem.router.app, tandem.router.cli; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'")
    subprocess.run([sys.executable, "-c", code], check=True)


def _pod_events(role: str, uid: str, ip: str, generation: str = "g1") -> list[tuple[str, dict]]:
    """A pod's life as the API server reports it, built from the operator's own pod template:
    created (not ready), ready, marked for deletion (still Ready while it drains), deleted."""
    import copy

    from operator_support import EXAMPLES_DIR, load_example

    from tandem.operator.reconcile import reconcile
    from tandem.worker_contract import GENERATION_LABEL

    kids = {(c["kind"], c["metadata"]["name"]): c for c in reconcile(load_example(EXAMPLES_DIR /
                                                                                     "inferenceservice-minimal.yaml"))}
    dep = next(c for (kind, _), c in kids.items()
               if kind == "Deployment" and c["metadata"]["labels"]["app.kubernetes.io/component"] == role)
    template = dep["spec"]["template"]
    pod = {"metadata": {**copy.deepcopy(template["metadata"]), "name": f"{role}-{uid}", "uid": uid},
           "spec": copy.deepcopy(template["spec"]), "status": {"phase": "Pending"}}
    pod["metadata"]["labels"][GENERATION_LABEL] = generation
    created = copy.deepcopy(pod)
    running = copy.deepcopy(pod)
    running["status"] = {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
    terminating = copy.deepcopy(running)
    terminating["metadata"]["deletionTimestamp"] = "2026-11-23T02:00:00Z"
    return [("ADDED", created), ("MODIFIED", running), ("MODIFIED", terminating), ("DELETED", terminating)]


def test_discovery_follows_pod_events_and_drops_a_terminating_pod_at_once() -> None:
    from tandem.router.discovery import PodDiscovery
    from tandem.router.workers import DECODE, PREFILL, WorkerSet

    ws = WorkerSet()
    removed: list[str] = []
    d = PodDiscovery(ws, "default", {PREFILL: "x", DECODE: "y"}, on_remove=removed.append)
    pre, dec = _pod_events(PREFILL, "p1", "10.0.0.1"), _pod_events(DECODE, "d1", "10.0.0.2")
    d.apply(*pre[0], PREFILL)
    assert not ws.workers  # not ready yet
    d.apply(*pre[1], PREFILL)
    d.apply(*dec[1], DECODE)
    p = ws.workers["http://10.0.0.1:8000"]
    assert p.role == PREFILL and p.bootstrap_port == 8998 and p.generation == "g1"
    assert ws.workers["http://10.0.0.2:8000"].role == DECODE
    d.apply(*pre[2], PREFILL)  # deletionTimestamp set: gone before its endpoints are
    assert "http://10.0.0.1:8000" not in ws.workers and removed == ["http://10.0.0.1:8000"]
    d.apply(*pre[3], PREFILL)  # the DELETED event after it changes nothing
    d.apply(*dec[3], DECODE)
    assert not ws.workers


def test_pd_pairs_only_one_generation() -> None:

    from tandem.router.metrics import RouterMetrics
    from tandem.router.proxy import Job, Proxy, ProxyConfig
    from tandem.router.upstream import Upstream
    from tandem.router.workers import COLOCATED, DECODE, PREFILL, WorkerSet

    ws = WorkerSet()
    ws.add(Worker("http://p-old:8000", PREFILL, 8998, "old"))
    ws.add(Worker("http://p-new:8000", PREFILL, 8998, "new"))
    ws.add(Worker("http://d-new:8000", DECODE, None, "new"))
    policies = {r: RoundRobin() for r in (COLOCATED, PREFILL, DECODE)}
    proxy = Proxy(ProxyConfig(local_prefill_threshold=0), ws, policies, RouterMetrics(), Upstream())
    for _ in range(4):
        route = proxy.choose(Job("/generate", {"text": "x"}, list(range(64)), 100, False), set())
        assert route.prefill.url == "http://p-new:8000" and route.body["bootstrap_host"] == "p-new"


def test_output_tokens_from_usage_and_meta_info():
    from tandem.router.reported import output_tokens

    body = b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}}'
    assert output_tokens(body, 0) == 7
    generate_n2 = b'[{"meta_info": {"completion_tokens": 4}}, {"meta_info": {"completion_tokens": 5}}]'
    assert output_tokens(generate_n2, 0) == 9
    stream = b'data: {"meta_info": {"completion_tokens": 1}}\n\ndata: {"meta_info": {"completion_tokens": 2}}\n\n'
    assert output_tokens(stream, None, last=True) == 2 and output_tokens(b"data: {}", None) is None


def test_cache_aware_places_tenants_by_traffic_volume() -> None:
    """8 tenants with uneven traffic over 4 idle workers (nothing in flight, so only the
    volume counts can balance them): requests served stay within 1.3x max/min, and a tenant's
    prefix is copied to a second worker only a few times (each copy is one extra miss)."""
    import random

    rng = random.Random(0)
    tenants = [[rng.randrange(10, 8000) for _ in range(64)] for _ in range(8)]
    pool = _pool()
    pol = CacheAware(PrefixIndex(block=4))
    served = {w.url: 0 for w in pool}
    for _ in range(256):
        ids = rng.choices(tenants, weights=[3, 2, 2, 1, 1, 1, 1, 1])[0] + [rng.randrange(10, 8000)] * 4
        w, _ = pol.pick(pool, ids)
        served[w.url] += 1
    assert max(served.values()) <= 1.3 * min(served.values()), served
    assert pol.misses <= 8 + 8, pol.misses  # one per tenant, plus the copies of the heaviest
