"""A CPU decode step with each decoder layer in one kernel call (models/fused_decode.py) against the
same step through the layers' modules, which call the same kernels one by one from Python. Same
runner, same KV, alternating: each round times --repeat steps of each; the ratio is modules / one
call, the median over rounds. fp32 only (the panels are fp32's small-rows form).

    python bench/cpu_fused_decode.py --model smollm2 --batches 1,4,16,64 --rounds 7 --repeat 5

Output: a table and docs/results/cpu_fused_decode_<model>.json (--out to change).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_stream_linears import add_step_args, decode_step  # noqa: E402
from forward import median_ms  # noqa: E402
from run_meta import run_meta  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _through_modules(model: torch.nn.Module, fused: object, step):  # type: ignore[no-untyped-def]
    """`step` with the model's layers run by their modules."""
    def run() -> None:
        model.fused_decode = None
        try:
            step()
        finally:
            model.fused_decode = fused
    return run


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    add_step_args(ap, batches="1,4,16,64", ctx=200, rounds=7, repeat=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tandem.engine.modelgen.resolve import resolve_model

    path = str(resolve_model(args.model))
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        runner_box: list = []
        _, step = decode_step(path, batch, args.ctx, None, "float32", runner_box=runner_box,
                              steps=2 * args.rounds * args.repeat + 2)
        model = runner_box[0].model
        fused = model.fused_decode
        if fused is None or batch > fused.max_rows:
            print(json.dumps({"batch": batch, "skipped": "no one-call layers for this model, CPU or batch"}))
            continue

        modules = _through_modules(model, fused, step)
        step(), modules()  # warm-up
        on_ms, off_ms = [], []
        for _ in range(args.rounds):
            on_ms.append(median_ms(step, args.repeat))
            off_ms.append(median_ms(modules, args.repeat))
        row = {"batch": batch, "one_call_ms": round(statistics.median(on_ms), 3),
               "modules_ms": round(statistics.median(off_ms), 3),
               "modules_over_one_call": round(statistics.median(f / o for f, o in zip(off_ms, on_ms)), 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"model": args.model, "dtype": "float32", "ctx": args.ctx, "threads": args.threads, "rows": rows,
              "meta": run_meta(torch.device("cpu"))}
    out = Path(args.out) if args.out else ROOT / f"docs/results/cpu_fused_decode_{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
