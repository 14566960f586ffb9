"""End to end through the whole stack, as a user measures it: `tandem up` and `tandem bench
--compare`, both sides on the identical request list in one run (A, B, then B, A...).

    python bench/e2e.py pd   --model tiny   # tandem up (1 prefill + 1 decode) vs tandem up --colocated
    python bench/e2e.py vllm --model tiny   # tandem up --colocated vs vLLM's CPU server (own venv)
    python bench/e2e.py vllm --concurrency 16   # closed loop: the most each side carries

Both sides stay up for the whole run; an idle stack costs no measurable CPU (its processes
sleep), so neither side is frozen while the other runs. Results: docs/results/e2e_<mode>_<model>/
bench.json and bench.png; `tandem bench`'s table is printed (B/A ratios).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests/server"))
from serve import VllmOpenAIServer  # noqa: E402
from test_up import Stack  # noqa: E402

from tandem.cli import main as tandem  # noqa: E402
from tandem.engine.modelgen.resolve import resolve_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["pd", "vllm"])
    p.add_argument("--model", default="tiny")
    p.add_argument("--workload", default="sharegpt")
    p.add_argument("--rate", default="2")
    p.add_argument("--concurrency", default=None, help="closed loop instead of --rate: the capacity")
    p.add_argument("--num-requests", default="60")
    p.add_argument("--rounds", default="2")
    p.add_argument("--bench-arg", action="append", default=[], help="passed to tandem bench")
    args = p.parse_args()
    model = resolve_model(args.model)
    load = ["--concurrency", args.concurrency] if args.concurrency else ["--rate", args.rate]
    out = ROOT / f"docs/results/e2e_{args.mode}_{args.model}" if not args.concurrency else \
        ROOT / f"docs/results/e2e_{args.mode}_{args.model}_c{args.concurrency}"
    small = "--max-total-tokens 65536"
    a = Stack(model, "--no-check", "--worker-args", small) if args.mode == "pd" else None
    b = Stack(model, "--no-check", "--colocated", "--worker-args", small)
    vllm = VllmOpenAIServer(str(model), "bfloat16", "tiny") if args.mode == "vllm" else None
    try:
        for s in (a, b):
            if s is not None:
                s.wait_up()
        first, second = (a.url, b.url) if a else (b.url, vllm.url)  # type: ignore[union-attr]
        labels = "pd,colocated" if a else "tandem,vllm"
        code = tandem(["bench", "--url", first, "--compare", second, "--labels", labels, "--model", "tiny",
                       "--workload", args.workload, *load, "--num-requests", args.num_requests,
                       "--rounds", args.rounds, "--output-len", "16:128", "--prompt-len", "16:512",
                       "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--out", str(out), *args.bench_arg])
    finally:
        for s in (a, b):
            if s is not None:
                s.stop()
        if vllm is not None:
            vllm.stop()
    sys.exit(code)


if __name__ == "__main__":
    main()
