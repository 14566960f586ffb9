"""What deterministic mode costs, and what it buys, side by side in one process.

    python bench/deterministic_cost.py --model smollm2 --dtypes bfloat16,float32 --rounds 3

For each dtype, two offline Engines over the same model (the default mode and
`deterministic=True`) run the same workloads in alternating rounds (A B A B ...), so drift on
a shared machine hits both; each figure is the median over rounds, each ratio the median of
the per-round ratios:

    decode-1     one request, 64 new tokens            (tok/s of output)
    decode-16    16 requests together, 64 new tokens   (tok/s of output)
    prefill      8 prompts of 512 tokens, 1 new token  (tok/s of prompt)

Then the README's question, asked three times through the chat template in each mode (the
second and third hit the radix cache): the answers, and whether they agree.
Results go to docs/results/deterministic_cost.json (--out to change).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from run_meta import run_meta  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What is the capital of France?"


def _workloads(vocab: int) -> dict[str, tuple[list[list[int]], dict]]:
    import torch

    g = torch.Generator().manual_seed(0)
    ids = lambda n, k: [torch.randint(100, vocab, (n,), generator=g).tolist() for _ in range(k)]  # noqa: E731
    decode = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    return {
        "decode-1": (ids(32, 1), decode),
        "decode-16": (ids(32, 16), decode),
        "prefill": (ids(512, 8), {"max_new_tokens": 1, "temperature": 0}),
    }


def _timed(eng, prompts: list[list[int]], sp: dict, kind: str) -> float:
    eng.flush_cache()  # every round computes its prompts: a radix hit would time nothing
    t = time.perf_counter()
    outs = eng.generate(prompts, sp)
    dt = time.perf_counter() - t
    tokens = sum(len(p) for p in prompts) if kind == "prefill" else sum(len(o["token_ids"]) for o in outs)
    return tokens / dt


def _ask(eng, times: int) -> list[str]:
    prompt = eng.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                               add_generation_prompt=True)
    eng.flush_cache()
    return [eng.generate([prompt], {"max_new_tokens": 48, "temperature": 0})[0]["text"] for _ in range(times)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "deterministic_cost.json")
    args = ap.parse_args()

    import torch

    from tandem import Engine
    from tandem.engine.kernels import cpu_plan

    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict = {"model": args.model, "cpu_level": cpu_plan.current().level, "threads": torch.get_num_threads(),
                    "rounds": args.rounds, "dtypes": {}}
    for dtype in args.dtypes.split(","):
        base = dict(dtype=dtype, max_total_tokens=16384, max_running_requests=32, chunked_prefill_size=2048)
        engines = {"default": Engine(args.model, **base), "deterministic": Engine(args.model, **base,
                                                                                 deterministic=True)}
        work = _workloads(engines["default"].tokenizer.vocab_size)
        for eng in engines.values():  # warm-up: every shape the rounds will use
            for prompts, sp in work.values():
                eng.generate(prompts, {**sp, "max_new_tokens": 2})
        runs: dict[str, dict[str, list[float]]] = {m: {w: [] for w in work} for m in engines}
        for _ in range(args.rounds):
            for w, (prompts, sp) in work.items():
                for mode, eng in engines.items():
                    runs[mode][w].append(_timed(eng, prompts, sp, w))
        answers = {mode: _ask(eng, 3) for mode, eng in engines.items()}
        for eng in engines.values():
            eng.shutdown()
        row = {}
        for w in work:
            ratios = [d / b for d, b in zip(runs["deterministic"][w], runs["default"][w])]
            row[w] = {"default_tok_s": statistics.median(runs["default"][w]),
                      "deterministic_tok_s": statistics.median(runs["deterministic"][w]),
                      "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
        result["dtypes"][dtype] = {"workloads": row, "answers": answers,
                                   "same_answer": {m: len(set(a)) == 1 for m, a in answers.items()}}
        print(f"\n{dtype} ({result['cpu_level']}, {result['threads']} threads, {args.rounds} rounds)")
        print(f"  {'workload':<10} {'default tok/s':>14} {'deterministic':>14} {'ratio':>7}")
        for w, r in row.items():
            print(f"  {w:<10} {r['default_tok_s']:>14.1f} {r['deterministic_tok_s']:>14.1f} {r['ratio']:>7.2f}")
        for mode, a in answers.items():
            print(f"  README question x3, {mode}: {'same' if len(set(a)) == 1 else 'DIFFERENT'}: {a[0][:60]!r}")
    result["meta"] = run_meta(torch.device("cpu"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
