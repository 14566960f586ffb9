"""Paired latency of `tandem serve` variants: one live server per variant (environment and
flags), each request sent to every server in turn with the others frozen (SIGSTOP), and the
ratio taken per request. On a shared 2-core VM the same measurement swings by 1.5x from one
minute or process to the next; a pair of requests a second apart sees the same machine.

    python bench/serve_variants.py --model smollm2 --dtype float32 \
        --variant tuned= --variant heap64=MALLOC_MMAP_THRESHOLD_=65536 --rounds 3

`--variant NAME=[KEY=VALUE,...][;--flag value ...]` names a server: environment pairs before
the ';', extra `tandem serve` flags after. The first variant is the base; each row is a
prompt length, and the result is per variant the median over requests of base / variant
(above 1: the variant is faster). Prefill: a random prompt (token ids) of each `--lengths` (no prefix
reuse), max_tokens 1, non-streamed. Decode: `--decode-tokens` more tokens after a 100-token
prompt, per token, the prefill of another prompt of that length subtracted. Results go to
docs/results/serve_variants_<name>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests/support"))
from run_meta import environment  # noqa: E402
from serve import Frozen  # noqa: E402
from worker_process import Worker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def parse_variant(spec: str) -> tuple[str, dict[str, str], list[str]]:
    name, _, rest = spec.partition("=")
    env_part, _, flags = rest.partition(";")
    env = dict(pair.split("=", 1) for pair in env_part.split(",") if pair)
    return name, env, flags.split()


def timed(url: str, prompt: list[int], max_tokens: int) -> float:
    t = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=600, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
    r.raise_for_status()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--variant", action="append", required=True, help="NAME=[K=V,...][;flags] (repeatable)")
    ap.add_argument("--lengths", default="35,111,256")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default=None, help="results file suffix (default: the variant names)")
    ap.add_argument("--out", default=None, help="the results file (default: docs/results/serve_variants_<name>.json)")
    args = ap.parse_args()
    from tandem.engine.modelgen.resolve import resolve_model

    model = str(resolve_model(args.model))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    variants = [parse_variant(v) for v in args.variant]
    names = [v[0] for v in variants]
    lengths = [int(n) for n in args.lengths.split(",")]
    rng = random.Random(1)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    with ExitStack() as stack:
        servers: dict[str, Worker] = {}
        for name, env, flags in variants:
            servers[name] = stack.enter_context(Worker(
                ["serve", "--model", model, "--served-model-name", "m", "--dtype", args.dtype, *flags], env=env))
        for w in servers.values():
            w.wait_ready(timeout=600)

        def on(name: str, fn, *a):  # the others frozen, so none takes CPU from this one
            with ExitStack() as frozen:
                for other, w in servers.items():
                    if other != name:
                        frozen.enter_context(Frozen(w.proc))
                return fn(servers[name].url, *a)

        for name in names:  # warm-up: every row bucket of the lengths, and a decode
            for n in range(32, max(lengths) + 32, 32):
                on(name, timed, prompt(n), 1)
            on(name, timed, prompt(100), 4)
        rows: list[dict] = []
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for n in lengths:
                p = prompt(n)
                ms = {name: on(name, timed, p, 1) * 1e3 for name in order}
                rows.append({"case": f"prefill {n}", "round": r, "ms": ms})
                print(json.dumps(rows[-1] | {"ms": {k: round(v) for k, v in ms.items()}}), flush=True)
            # Two prompts of one length: the same one again would hit the prefix cache, and the
            # subtracted prefill would be near zero.
            p, q = prompt(100), prompt(100)
            ms = {name: (on(name, timed, p, args.decode_tokens + 1) - on(name, timed, q, 1)) * 1e3
                  / args.decode_tokens for name in order}
            rows.append({"case": "decode ms/token", "round": r, "ms": ms})
            print(json.dumps(rows[-1] | {"ms": {k: round(v, 1) for k, v in ms.items()}}), flush=True)
    base = names[0]
    summary = {}
    for case in dict.fromkeys(row["case"] for row in rows):
        mine = [row["ms"] for row in rows if row["case"] == case]
        summary[case] = {name: {"median_ms": round(statistics.median(m[name] for m in mine), 1),
                                "base_over_variant": round(statistics.median(m[base] / m[name] for m in mine), 3)}
                         for name in names}
    overall = {name: round(statistics.median(row["ms"][base] / row["ms"][name] for row in rows), 3) for name in names}
    print(json.dumps({"base": base, "base_over_variant": overall}))
    out = Path(args.out) if args.out else ROOT / "docs/results" / f"serve_variants_{args.name or '_'.join(names)}.json"
    out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "variants": args.variant, "base": base,
                               "summary": summary, "base_over_variant": overall, "rows": rows,
                               "environment": environment(torch.device("cpu"))}, indent=2))
    print("->", out)


if __name__ == "__main__":
    main()
