"""A CPU decode step with the linears as the runner chooses them by default (oneDNN-packed, and
a second form of each weight for small batches: `cpu_stream_linears`, models/layers.py
PackedLinear) against a baseline form, same model, same run: oneDNN's packed matmuls alone
(--baseline packed), torch's plain linear, unpacked (--baseline unpacked), or, for fp32, the
form before the panels (--baseline streamed: the plain weight streamed for up to STREAM_ROWS
rows, oneDNN above).

    python bench/cpu_stream_linears.py --model smollm2 --batches 1,2,3,4,5,8 --rounds 5
    python bench/cpu_stream_linears.py --model smollm2 --dtype float32 --baseline unpacked \
        --batches 1,2,4,8,16,64 --rounds 5 --repeat 3
    python bench/cpu_stream_linears.py --model smollm2 --dtype float32 --baseline streamed \
        --batches 1,2,4,8,16,32,64,128,192,256 --rounds 5 --repeat 3

A decode step of one request multiplies one row by every weight: the step is the time to read
the weights. oneDNN's packed bf16 GEMM reads them at a third to a half of this machine's bandwidth
at such sizes; the streamed form (kernels/cpu_kernels.stream_linear) at close to all of it. Rows
above STREAM_ROWS use oneDNN either way, so those batches show the two equal. Each round times
--repeat steps of each variant, alternating; the ratio is off / on (baseline / default), the
median over rounds. Output: a table and docs/results/cpu_stream_linears_<model>[_<dtype>]
[_vs_unpacked].json (--out to change).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from forward import median_ms  # noqa: E402
from run_meta import run_meta  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def as_before_panels(model: torch.nn.Module) -> None:
    """fp32 packed linears as they ran before the panel kernel: the plain weight (unpacked from the
    panels) streamed for up to STREAM_ROWS rows."""
    from tandem.engine.models.layers import STREAM_ROWS, PackedLinear

    for m in model.modules():
        if isinstance(m, PackedLinear) and m.panels:
            plain = m.small.transpose(1, 2).reshape(-1, m.in_features)[:m.out_features].contiguous()
            m.small, m.panels, m.small_rows = plain, False, STREAM_ROWS
    model.fused_decode = None  # its layers read the panels (models/fused_decode.py)


def decode_step(path: str, batch: int, ctx: int, stream: bool | None, dtype: str = "bfloat16", packed: bool = True,
                before_panels: bool = False, runner_box: list | None = None, steps: int = 64):
    """One decode step of `batch` requests with `ctx` tokens cached each, as a callable good for
    `steps` calls (the runner appended to `runner_box` when given)."""
    from tandem.engine.model_config import RunnerConfig
    from tandem.engine.runner.model_runner import ModelRunner
    from tandem.engine.runner.static_generate import StaticBatch

    config = RunnerConfig(dtype=dtype, page_size=16, max_total_tokens=batch * (ctx + steps) + 64,
                          max_running_requests=batch, cpu_stream_linears=stream, cpu_packed_linear=packed)
    runner = ModelRunner.load(path, config)
    if before_panels:
        as_before_panels(runner.model)
    if runner_box is not None:
        runner_box.append(runner)
    sb = StaticBatch(runner)
    g = torch.Generator().manual_seed(0)
    seqs = sb.new(batch)
    sb.forward(seqs, [torch.randint(10, runner.vocab_size, (ctx,), generator=g).tolist() for _ in range(batch)])
    return runner.stream_linears, lambda: sb.forward(seqs, [[7]] * batch)


def add_step_args(ap: argparse.ArgumentParser, *, batches: str, ctx: int, rounds: int, repeat: int) -> None:
    """The decode-step benchmarks' shared options (this file and cpu_fused_decode.py)."""
    ap.add_argument("--batches", default=batches)
    ap.add_argument("--ctx", type=int, default=ctx)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--repeat", type=int, default=repeat)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--baseline", default="packed", choices=["packed", "unpacked", "streamed"],
                    help="off: oneDNN's packed matmuls alone, torch's plain linear, or fp32 before the panels")
    add_step_args(ap, batches="1,2,3,4,5,8", ctx=256, rounds=5, repeat=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tandem.engine.modelgen.resolve import resolve_model
    from tandem.engine.models.layers import STREAM_ROWS, panel_rows

    path = str(resolve_model(args.model))
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        streamed, on = decode_step(path, batch, args.ctx, True, args.dtype)
        streamed_off = args.baseline == "streamed"
        _, off = decode_step(path, batch, args.ctx, streamed_off, args.dtype, packed=args.baseline != "unpacked",
                             before_panels=streamed_off)
        on(), off()  # warm-up: oneDNN builds its kernels for the shape
        on_ms, off_ms = [], []
        for _ in range(args.rounds):
            on_ms.append(median_ms(on, args.repeat))
            off_ms.append(median_ms(off, args.repeat))
        small_rows = panel_rows() if args.dtype == "float32" else STREAM_ROWS
        row = {"batch": batch, "small_rows_form": streamed and batch <= small_rows,
               "on_ms": round(statistics.median(on_ms), 3), "off_ms": round(statistics.median(off_ms), 3),
               "off_over_on": round(statistics.median(f / o for f, o in zip(off_ms, on_ms)), 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"model": args.model, "dtype": args.dtype, "baseline": args.baseline, "ctx": args.ctx,
              "threads": args.threads, "stream_rows": STREAM_ROWS, "panel_rows": panel_rows(), "rows": rows,
              "meta": run_meta(torch.device("cpu"))}
    tag = ("" if args.dtype == "bfloat16" else f"_{args.dtype}")
    tag += "" if args.baseline == "packed" else f"_vs_{args.baseline}"
    out = Path(args.out) if args.out else ROOT / f"docs/results/cpu_stream_linears_{args.model}{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
