"""cache_aware placement, offline: the policy driven directly on bench/router.py's cache workload,
with simulated workers instead of servers. Deterministic (fixed seeds), no wall clock, ~30 s on one core.

    python bench/placement_sim.py                     # before vs after, 2/4/8 workers
    python bench/placement_sim.py --zipf 1.0          # tenants drawn Zipf(1.0), not uniformly
    python bench/placement_sim.py --service parallel  # no queueing on a worker
    python bench/placement_sim.py --model DIR         # the model's tokenizer, not UTF-8 bytes
    python bench/placement_sim.py --bounds            # balance with no copies: known volumes vs online
    python bench/placement_sim.py --frontier          # hit rate vs balance as the volume bound relaxes

Workload: bench/router.py's own `_tenant_workload(seed)` (imported: 8 tenants, each a
300-word system prompt, drawn uniformly; 128 requests a round). `--zipf` rebuilds it with
Zipf weights (same shapes, another random stream). Prompts are encoded as the router does with
no model mounted (UTF-8 bytes, router/tokenizer.py ByteTokenizer), or with `--model`'s tokenizer.

As the bench: `--rounds` rounds (2) per router, the router keeping its state between rounds,
each round a new set of tenants (seed = round number) and the workers' caches flushed before
it; `--trials` such runs (25) on seeds 0, 1, ... for steadier figures (trial t: rounds 2t, 2t+1).

Workers: a closed loop of `--concurrency` clients (8, as the bench) sends the requests in order.
The router's view of load is counted as router/proxy.py does (requests and prompt + max_tokens
tokens in flight, from dispatch to the end). A request's service time is exponential (seeded),
its mean 1 + `--miss-cost` x the fraction of its prompt the worker had to compute; `fifo`
workers (the default) serve one request at a time, as a compute-bound CPU worker does, so a
slow prefill holds up the requests behind it. With fifo and a miss cost of 20 the "before"
policy loses hit rate to in-flight spills about as it does on the real bench (4 workers: 0.82
and max/min 1.25 here, 0.83 and 1.36 there); with no queueing it would lose far less (0.875).

Each worker has a token-level LRU prefix cache of `--capacity` tokens (the bench's
--max-total-tokens 16384). Hit rate = cached prompt tokens / prompt tokens (what bench/router.py
reads from the workers' meta_info), over all rounds; load = max/min requests served per worker in
a round: the median and the worst round. "before" is router/policies/cache_aware.py at git revision
`--before-rev`, loaded with `git show`; "after" is the working tree's.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import importlib.util
import itertools
import random
import statistics
import subprocess
import sys
import types
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from tandem.router.prefix_index import PrefixIndex
from tandem.router.tokenizer import ByteTokenizer, RouterTokenizer
from tandem.router.workers import Worker

ROOT = Path(__file__).resolve().parent.parent
BEFORE_REV = "56bd7a2"  # the last commit with the copy-on-overload, spill-at-4-ahead placement
MAX_TOKENS = 4  # bench/router.py's max_new_tokens: part of a request's outstanding tokens
Prompt = tuple[list[int], list[int]]  # ids, and one name per token position (token_chain)


def bench_workload() -> Callable[[int], list[str]]:
    """bench/router.py's generator, imported by path (its module name would clash with router/)."""
    spec = importlib.util.spec_from_file_location("bench_router", ROOT / "bench/router.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # imports httpx and the test helpers; starts nothing
    return mod._tenant_workload


def zipf_workload(s: float) -> Callable[[int], list[str]]:
    """bench/router.py's generator with tenants drawn with weights 1/(k+1)^s."""
    def gen(seed: int) -> list[str]:
        rng = random.Random(seed)
        words = [f"w{i}" for i in range(2000)]
        systems = [" ".join(rng.choice(words) for _ in range(300)) for _ in range(8)]
        weights = [1 / (k + 1) ** s for k in range(8)]
        return [f"{rng.choices(systems, weights)[0]} question {i}: {' '.join(rng.choice(words) for _ in range(12))}"
                for i in range(128)]
    return gen


def load_policies(rev: str | None) -> types.ModuleType:
    """router/policies/cache_aware.py at `rev` (None: the working tree's), as a module of its own."""
    if rev is None:
        import tandem.router.policies.cache_aware as current

        return current
    # cache_aware lived in router/policies.py (one Policy class, chosen by name) before it had a module.
    show = [subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
            for path in ("router/policies/cache_aware.py", "router/policies.py")]
    src = next(r.stdout for r in show if r.returncode == 0)
    mod = types.ModuleType(f"policies_{rev}")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up there
    exec(compile(src, f"policies@{rev}", "exec"), mod.__dict__)  # noqa: S102 - our own file, a known commit
    return mod


def token_chain(ids: list[int]) -> list[int]:
    """One name per token position, standing for the whole prefix up to it (a radix path)."""
    out, h = [], 0
    for t in ids:
        h = hash((h, t))
        out.append(h)
    return out


class TokenCache:
    """A worker's prefix cache at token granularity, LRU, leaves evicted before their parents."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.held = capacity, OrderedDict()

    def serve(self, chain: list[int]) -> int:
        """Cached tokens for this prompt (one at least is computed, as in a radix cache); then the
        prompt is cached."""
        hit = 0
        while hit < len(chain) - 1 and chain[hit] in self.held:
            hit += 1
        for name in reversed(chain):
            self.held[name] = None
            self.held.move_to_end(name)
        while len(self.held) > self.capacity:
            self.held.popitem(last=False)
        return hit


def run_round(pol, workers: list[Worker], prompts: list[Prompt], args: argparse.Namespace,
              rng: random.Random) -> tuple[int, int, dict[str, int]]:
    """(cached tokens, prompt tokens, requests served per worker) of one round."""
    caches = {w.url: TokenCache(args.capacity) for w in workers}  # flushed, as the bench flushes them
    served = dict.fromkeys((w.url for w in workers), 0)
    free = dict.fromkeys((w.url for w in workers), 0.0)  # when each worker is done with its queue
    running: list[tuple[float, int, Worker, int]] = []
    now, cached, total = 0.0, 0, 0
    for k, (ids, chain) in enumerate(prompts):
        if len(running) >= args.concurrency:  # closed loop: the next request leaves when one ends
            now, _, done, n = heapq.heappop(running)
            done.requests, done.tokens = done.requests - 1, done.tokens - n
        w, _ = pol.pick(workers, ids)
        n = len(ids) + MAX_TOKENS
        w.requests, w.tokens = w.requests + 1, w.tokens + n
        hit = caches[w.url].serve(chain)
        served[w.url] += 1
        cached, total = cached + hit, total + len(ids)
        work = rng.expovariate(1.0) * (1 + args.miss_cost * (len(ids) - hit) / len(ids))
        free[w.url] = (max(now, free[w.url]) if args.service == "fifo" else now) + work
        heapq.heappush(running, (free[w.url], k, w, n))
    for _, _, done, n in running:
        done.requests, done.tokens = done.requests - 1, done.tokens - n
    return cached, total, served


def measure(mod: types.ModuleType, n_workers: int, rounds: list[list[Prompt]],
            args: argparse.Namespace, **policy: float) -> tuple[float, list[float]]:
    """(hit rate over all rounds, max/min served of each round): a fresh router per trial."""
    cached = total = 0
    loads = []
    for t in range(args.trials):
        make = getattr(mod, "CacheAware", None) or functools.partial(mod.Policy, "cache_aware")
        pol = make(PrefixIndex(), seed=args.seed, **policy)
        workers = [Worker(f"http://w{i}") for i in range(n_workers)]
        rng = random.Random(args.seed + t)
        for prompts in rounds[t * args.rounds:(t + 1) * args.rounds]:
            c, n, served = run_round(pol, workers, prompts, args, rng)
            cached, total = cached + c, total + n
            loads.append(max(served.values()) / max(1, min(served.values())))
    return cached / total, loads


def ceiling(prompts: list[Prompt]) -> float:
    """The hit rate with each tenant's prompt computed once (one worker, an unbounded cache)."""
    cache, cached = TokenCache(1 << 30), 0
    for _, chain in prompts:
        cached += cache.serve(chain)
    return cached / sum(len(ids) for ids, _ in prompts)


def bounds(gen: Callable[[int], list[str]], rounds: int, workers: int = 4) -> None:
    """Max/min requests served with no tenant ever on two workers (every hit kept), over the
    workload's rounds: placed knowing each tenant's final volume (the best partition), dealt
    evenly as tenants appear, and each new tenant to the worker that has served least so far."""
    best, dealt, least = [], [], []
    for seed in range(rounds):
        tenant: dict[str, int] = {}
        seq = [tenant.setdefault(p.split(" question ")[0], len(tenant)) for p in gen(seed)]
        volume = [seq.count(t) for t in range(len(tenant))]
        spread = lambda served: max(served) / max(1, min(served))  # noqa: E731
        best.append(min(spread([sum(v for v, w in zip(volume, a) if w == k) for k in range(workers)])
                        for a in itertools.product(range(workers), repeat=len(volume))))
        dealt.append(spread([sum(v for t, v in enumerate(volume) if t % workers == k) for k in range(workers)]))
        served, owner = [0] * workers, {}
        for t in seq:
            served[owner.setdefault(t, min(range(workers), key=served.__getitem__))] += 1
        least.append(spread(served))
    print(f"| no copies, {workers} workers, {rounds} rounds | median max/min | rounds over 1.3 |\n|---|---|---|")
    for name, xs in (("knowing final volumes", best), ("dealt evenly", dealt), ("least served so far", least)):
        print(f"| {name} | {statistics.median(xs):.2f} | {sum(x > 1.3 for x in xs) / len(xs):.0%} |")


def frontier(rounds: list[list[Prompt]], args: argparse.Namespace, workers: int = 4) -> None:
    """The working tree's policy with its volume bound relaxed step by step: hit rate against balance."""
    print("| volume_balance | hit rate | max/min: median (worst) |\n|---|---|---|")
    for vb in (1.15, 1.3, 1.5, 2.0, 100.0):
        hit, loads = measure(load_policies(None), workers, rounds, args, volume_balance=vb)
        print(f"| {vb:g} | {hit:.3f} | {statistics.median(loads):.2f} ({max(loads):.2f}) |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rounds", type=int, default=2, help="rounds per router, state kept (the bench: 2)")
    ap.add_argument("--trials", type=int, default=25, help="fresh routers, each on its own rounds")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=16384, help="tokens each worker caches")
    ap.add_argument("--service", choices=["fifo", "parallel"], default="fifo")
    ap.add_argument("--miss-cost", type=float, default=20.0, help="extra service time of an uncached prompt")
    ap.add_argument("--zipf", type=float, default=None, help="Zipf exponent of tenant popularity")
    ap.add_argument("--model", default=None, help="a model dir whose tokenizer encodes the prompts")
    ap.add_argument("--before-rev", default=BEFORE_REV)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bounds", action="store_true", help="balance without copies: known volumes vs online rules")
    ap.add_argument("--frontier", action="store_true", help="hit rate vs balance as the volume bound relaxes")
    args = ap.parse_args()
    gen = bench_workload() if args.zipf is None else zipf_workload(args.zipf)
    if args.bounds:
        bounds(gen, args.trials * args.rounds)
        return
    tok = RouterTokenizer(args.model) if args.model else ByteTokenizer()
    rounds = []
    for r in range(args.trials * args.rounds):
        rounds.append([(ids, token_chain(ids)) for ids in map(tok.encode, gen(r))])
    if args.frontier:
        frontier(rounds, args)
        return
    top = statistics.mean(ceiling(p) for p in rounds)
    print(f"{args.trials} x {args.rounds} rounds of 128 requests, {args.concurrency} in flight, {args.service} "
          f"workers, miss cost {args.miss_cost:g}; hit-rate ceiling (one miss per tenant) {top:.3f}")
    print("| workers | hit rate before | hit rate after | max/min before: median (worst) | after |")
    print("|---|---|---|---|---|")
    mods = [load_policies(args.before_rev), load_policies(None)]
    for n in args.workers:
        (h0, l0), (h1, l1) = (measure(mod, n, rounds, args) for mod in mods)
        print(f"| {n} | {h0:.3f} | {h1:.3f} | {statistics.median(l0):.2f} ({max(l0):.2f}) | "
              f"{statistics.median(l1):.2f} ({max(l1):.2f}) |", flush=True)


if __name__ == "__main__":
    main()
