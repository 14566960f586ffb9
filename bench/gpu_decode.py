"""Decode and prefill throughput of our offline Engine vs HF transformers, same device, one run,
with % of two memory-bandwidth rooflines: a device-to-device copy measured in that run, and the
card's spec bandwidth (gpu_specs.py).

    # the target: an H200 (bf16, batches 1,16,64,256, context 512, prefill 8x2048)
    python bench/gpu_decode.py --model llama-1b-shape --device cuda
    python bench/gpu_decode.py --model llama-8b-shape --batches 1,64 --prefill none
    python bench/gpu_decode.py --model llama-1b-shape --engine-arg layer_ops=torch --hf-static off
    # CUDA graphs cover every batch up to max_running_requests; cap them to compare eager rows
    python bench/gpu_decode.py --model llama-1b-shape --engine-arg cuda_graph_max_bs=64
    # CPU smoke (CI): the tiny model, small shapes
    python bench/gpu_decode.py --model tiny --device cpu --batches 1,4 --context 32 --steps 8 --prefill 2x64

Decode time is a difference of two timed `generate` calls on the same prompts, both with the
prompts already in the prefix cache: T(steps new tokens) - T(1 new token). The cached prefill,
the first token and the request round trip cancel, leaving exactly steps-1 decode steps at the
full batch. Only the public API is used: `ttft` alone cannot say how many tokens the requests
admitted first decoded while later ones were still prefilling, and streaming every request
would need a consumer thread each, taking the GIL from the in-process scheduler. The rows keep
(T(steps) - slowest ttft) / (steps-1) as `engine_step_ms_ttft`, a cross-check.

HF gets the same treatment: generate(max_new_tokens=min_new_tokens=steps) minus generate(1), same
dtype, device and prompts (no padding), as two peers (hf_peers.py): `hf`, its default
DynamicCache, eager; `hf_static`, a StaticCache with the decode forward compiled (`--hf-static`,
on by default on CUDA).

Repeats: every peer first runs one whole round of the timed shape untimed (the first GPU run
warmed HF with a 2-token generate, and its first timed 64-token round took 3.04 s against 0.68 s
for the second), then `--repeats` timed rounds (odd, default 3), the peers alternating round by
round. Each figure is the median round, with its min and max beside it; every round is kept.

Roofline: bytes per decode step = weight bytes read (all parameters; an untied input embedding
is only gathered, so it is left out) + KV read, batch x (context + steps/2) x layers x 2 x
kv_heads x head_dim x dtype size; roofline step time = bytes / bandwidth, with bandwidth the
copy bandwidth = 2 x buffer bytes / time of dst.copy_(src) (read + write counted, the usual
convention; best of 10 on a 1 GiB buffer, 256 MiB on CPU), and again the spec bandwidth (None
for a card not in the table, and on CPU). % of roofline = roofline / measured.

Prefill: the Engine serves the prompts with max_new_tokens=1 from an empty prefix cache (its own
chunking and budgets apply); HF runs one forward of the same batch (use_cache, logits_to_keep=1).
The ratio is HF time / Engine time: >= 1 means ours is faster. Engine and HF alternate round by
round after a warm-up round; each figure is the median over --repeats rounds.

Every result carries `meta` (run_meta.py): the layer ops requested and chosen, the attention
backend and decode kernel, versions, the GPU, the commit. The JSON is written again after every
case, `complete: false` until the last: a run stopped at its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_specs import spec_bandwidth
from hf_peers import MODES, HFPeer, hf_peers
from run_meta import device_name, run_meta

ROOT = Path(__file__).resolve().parent.parent
COPY_CONVENTION = "copy bandwidth = 2 x buffer bytes / dst.copy_(src) time (read + write), best of 10"


def resolve(name: str) -> Path:
    """A preset name (llama-1b-shape is built once, 1-2 minutes) or a model directory."""
    from tandem.engine.modelgen.resolve import resolve_model

    return resolve_model(name)


def engine_args(items: list[str]) -> dict[str, Any]:
    """`key=value` pairs; values read as JSON when they parse (true, 256, 0.8, null), else strings."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg wants key=value, got {item!r}")
        low = value.lower()
        try:
            out[key] = json.loads(low if low in ("true", "false", "null") else value)
        except ValueError:
            out[key] = value
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """(seconds, fn's result), the device synchronised on both sides."""
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t, out


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10, inner: int = 4) -> float:
    """Bytes/s of dst.copy_(src), counting read + write (2 x nbytes); best of `reps` timings of
    `inner` back-to-back copies (so the synchronisation around a sub-ms copy does not count)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copies = lambda: [dst.copy_(src) for _ in range(inner)]  # noqa: E731
    return 2 * nbytes * inner / min(timed(copies, device)[0] for _ in range(reps))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from the weights: every parameter once (tied ones once), less an
    untied input embedding, of which a step gathers only `batch` rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    if not model.config.tie_word_embeddings:
        total -= emb.numel() * emb.element_size()
    return total


def kv_bytes_per_token(cfg: Any, dsize: int) -> int:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * dsize


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, length), generator=g).tolist()


def sp(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def flush(eng: Any) -> None:
    """Empty the prefix cache; the scheduler may take a moment to go idle after generate returns."""
    for _ in range(100):
        if all(r.ok for r in eng.flush_cache()):
            return
        time.sleep(0.05)
    raise RuntimeError("flush_cache: the engine did not go idle")


def summary(prefix: str, rounds_s: list[float], steps: int, batch: int) -> dict[str, Any]:
    """Median (and min/max) step time of a peer's timed rounds: each round is T(steps) - T(1),
    steps - 1 decode steps. The median of an odd count is a round's own figure, never a mean."""
    step_s = [r / (steps - 1) for r in rounds_s]
    med = statistics.median(step_s)
    return {f"{prefix}_step_ms": med * 1e3, f"{prefix}_step_ms_min": min(step_s) * 1e3,
            f"{prefix}_step_ms_max": max(step_s) * 1e3, f"{prefix}_tok_s": batch / med, f"{prefix}_rounds_s": rounds_s}


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


@torch.inference_mode()
def decode_case(eng: Any, hf: Any, peers: list[HFPeer], batch: int, args: argparse.Namespace,
                device: torch.device) -> dict:
    """One batch size: the Engine's and each HF peer's decode step (see the module docstring).
    Every peer first runs one whole round of the timed shape untimed (its prompts into the
    prefix cache, its kernels built, HF's static cache sized and its forward compiled), then
    `repeats` timed rounds, the peers alternating round by round. A peer that fails (a compile,
    say) is recorded as `<peer>_error` and dropped; the Engine's figures stand."""
    steps, prompts = args.steps, prompts_for(batch, args.context, hf.config.vocab_size, seed=batch)
    ids = torch.tensor(prompts, device=device)
    flush(eng)

    def engine_round() -> tuple[float, float, list[dict]]:
        t1, _ = timed(lambda: eng.generate(prompts, sp(1)), device)
        ts, outs = timed(lambda: eng.generate(prompts, sp(steps)), device)
        return t1, ts, outs

    def hf_round(peer: HFPeer) -> float:
        h1, _ = timed(lambda: peer.generate(hf, ids, 1), device)
        return timed(lambda: peer.generate(hf, ids, steps), device)[0] - h1

    engine_round()
    errors: dict[str, str] = {}
    h_dt: dict[str, list[float]] = {p.name: [] for p in peers}

    def hf_try(peer: HFPeer, record: bool) -> None:
        if peer.name in errors:
            return
        try:
            dt = hf_round(peer)
        except Exception as exc:  # a peer that cannot run here (no compiler, a graph break) loses only itself
            errors[peer.name] = _failure(exc)
            return
        if record:
            h_dt[peer.name].append(dt)

    for peer in peers:
        hf_try(peer, record=False)
    e_dt, e_ttft, outs = [], [], []
    for _ in range(args.repeats):
        t1, ts, outs = engine_round()
        e_dt.append(ts - t1)
        e_ttft.append(ts - max(o["meta"]["ttft"] for o in outs))  # cross-check: wall - slowest ttft
        for peer in peers:
            hf_try(peer, record=True)
    if any(o["meta"]["completion_tokens"] != steps for o in outs):
        raise RuntimeError(f"ignore_eos must give max_new_tokens={steps}: {[o['meta'] for o in outs][:2]}")
    cached = sum(o["meta"]["cached_tokens"] for o in outs) / sum(o["meta"]["prompt_tokens"] for o in outs)
    row = {"batch": batch, "context": args.context, "steps": steps, **summary("engine", e_dt, steps, batch),
           "engine_step_ms_ttft": statistics.median(e_ttft) / (steps - 1) * 1e3, "engine_prompt_cached_frac": cached}
    for peer in peers:
        if peer.name in errors:
            row[f"{peer.name}_error"] = errors[peer.name]
            continue
        row |= summary(peer.name, h_dt[peer.name], steps, batch)
        row[f"engine_over_{peer.name}"] = row[f"{peer.name}_step_ms"] / row["engine_step_ms"]
    return row


def add_roofline(row: dict, wbytes: int, kv_tok: int, bw: float, spec_bw: float | None) -> dict:
    """% of two rooflines per peer: the copy bandwidth measured in this run, and the card's spec."""
    kv = row["batch"] * (row["context"] + row["steps"] / 2) * kv_tok
    roof_ms = (wbytes + kv) / bw * 1e3
    roof_spec_ms = (wbytes + kv) / spec_bw * 1e3 if spec_bw else None
    out = {**row, "bytes_per_step": wbytes + kv, "kv_bytes_per_step": kv, "roofline_step_ms": roof_ms,
           "roofline_spec_step_ms": roof_spec_ms}
    for key in [k for k in row if k.endswith("_step_ms") and not k.startswith("roofline")]:
        peer = key.removesuffix("_step_ms")
        out[f"{peer}_pct_roofline"] = 100 * roof_ms / row[key]
        out[f"{peer}_pct_roofline_spec"] = 100 * roof_spec_ms / row[key] if roof_spec_ms else None
    return out


@torch.inference_mode()
def prefill_case(eng: Any, hf: Any, shape: str, repeats: int, device: torch.device) -> dict:
    n, length = (int(x) for x in shape.lower().split("x"))
    prompts = prompts_for(n, length, hf.config.vocab_size, seed=12345)
    ids = torch.tensor(prompts, device=device)
    forward = lambda: hf(ids, use_cache=True, logits_to_keep=1)  # noqa: E731
    e_s, h_s = [], []
    for i in range(repeats + 1):  # round 0 warms both up
        flush(eng)
        e, outs = timed(lambda: eng.generate(prompts, sp(1)), device)
        if sum(o["meta"]["cached_tokens"] for o in outs):
            raise RuntimeError("prefill must start from an empty prefix cache; flush_cache left some")
        h, _ = timed(forward, device)
        if i:
            e_s.append(e)
            h_s.append(h)
    e, h = statistics.median(e_s), statistics.median(h_s)
    return {"prefill": f"{n}x{length}", "engine_ms": e * 1e3, "hf_ms": h * 1e3, "hf_over_engine": h / e,
            "engine_tok_s": n * length / e, "hf_tok_s": n * length / h,
            "engine_ms_min_max": [min(e_s) * 1e3, max(e_s) * 1e3], "hf_ms_min_max": [min(h_s) * 1e3, max(h_s) * 1e3],
            "engine_rounds_s": e_s, "hf_rounds_s": h_s}


def _pct(value: float | None) -> str:
    return f"{value:.1f}%" if value is not None else "-"


def table(res: dict) -> str:
    spec = res["spec_bandwidth_GBps"]
    lines = [f"{res['device_name']} | torch {res['torch']} | {res['model']} {res['dtype']} | layer ops "
             f"{res['layer_ops']} | copy bw {res['copy_bandwidth_GBps']:.1f} GB/s ({COPY_CONVENTION}) | spec bw "
             + (f"{spec:.0f} GB/s" if spec else "unknown"),
             f"{'batch':>5} {'ctx':>5} {'peer':<10} {'ms/step':>9} {'min':>9} {'max':>9} {'tok/s':>10} "
             f"{'roof ms':>8} {'%roof':>7} {'%spec':>7}"]
    for r in res["decode"]:
        for peer in ["engine", *res["hf_peers"]]:
            if f"{peer}_error" in r:
                lines.append(f"{r['batch']:>5} {r['context']:>5} {peer:<10} failed: {r[f'{peer}_error'][:80]}")
                continue
            ms, lo, hi = (r[f"{peer}_step_ms{k}"] for k in ("", "_min", "_max"))
            lines.append(f"{r['batch']:>5} {r['context']:>5} {peer:<10} {ms:>9.3f} {lo:>9.3f} {hi:>9.3f} "
                         f"{r[f'{peer}_tok_s']:>10.1f} {r['roofline_step_ms']:>8.3f} "
                         f"{_pct(r[f'{peer}_pct_roofline']):>7} {_pct(r[f'{peer}_pct_roofline_spec']):>7}")
    p = res.get("prefill")
    if p:
        lines.append(f"prefill {p['prefill']}: engine {p['engine_ms']:.1f} ms, hf {p['hf_ms']:.1f} ms, "
                     f"hf/engine {p['hf_over_engine']:.2f} (>= 1: ours faster)")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b-shape", help="preset name, model dir, or llama-1b-shape")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--batches", default=None, help="comma-separated; default 1,16,64,256 (cuda), 1,4 (cpu)")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens; default 512 (cuda), 64 (cpu)")
    ap.add_argument("--steps", type=int, default=None, help="new tokens; default 128 (cuda), 16 (cpu)")
    ap.add_argument("--prefill", default=None, help="NxLEN; default 8x2048 (cuda), 2x128 (cpu); 'none' skips")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed rounds per case after a warm-up round, odd (the median is a round); 1 is a smoke run")
    ap.add_argument("--hf-static", choices=MODES, default="auto",
                    help="the StaticCache peer: compiled (default on CUDA), eager, off (default on CPU)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="EngineConfig option, repeatable (e.g. disable_cuda_graph=true, cuda_graph_max_bs=256)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default=None, help="default docs/results/gpu_decode_<device>.json")
    args = ap.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.batches = [int(b) for b in (args.batches or ("1,16,64,256" if cuda else "1,4")).split(",")]
    args.context = args.context or (512 if cuda else 64)
    args.steps = args.steps or (128 if cuda else 16)
    args.prefill = args.prefill or ("8x2048" if cuda else "2x128")
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (decode time is T(steps) - T(1))")
    if args.repeats < 1 or args.repeats % 2 == 0:
        raise SystemExit("--repeats must be odd: the median of an even count is the mean of two rounds")
    return args


def main() -> None:
    from transformers import AutoModelForCausalLM

    from tandem import Engine

    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    path = resolve(args.model)
    bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (256 << 20))
    name = device_name(device)
    spec_bw = spec_bandwidth(name) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the copy buffers back before the Engine sizes its KV pool
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    wbytes, kv_tok = weight_bytes(hf), kv_bytes_per_token(hf.config, dtype.itemsize)
    peers = hf_peers(args.hf_static, device.type)
    eargs = {"device": args.device, "dtype": args.dtype, **engine_args(args.engine_arg)}
    out = Path(args.out) if args.out else ROOT / "docs/results" / f"gpu_decode_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    import transformers

    res = {"device": args.device, "device_name": name, "torch": torch.__version__,
           "transformers": transformers.__version__, "model": args.model, "model_path": str(path),
           "dtype": args.dtype, "engine_args": eargs, "layer_ops": None, "hf_peers": [p.name for p in peers],
           "repeats": args.repeats, "warmup": "one untimed round of the timed shape per peer and batch",
           "copy_bandwidth_GBps": bw / 1e9, "copy_bandwidth_convention": COPY_CONVENTION,
           "spec_bandwidth_GBps": spec_bw / 1e9 if spec_bw else None, "weight_bytes": wbytes,
           "kv_bytes_per_token": kv_tok, "decode": [], "prefill": None, "complete": False}
    # Written again after every case: a run stopped at its time limit keeps the rows it finished.
    save = lambda: out.write_text(json.dumps(res, indent=2))  # noqa: E731
    with Engine(str(path), **eargs) as eng:
        res["meta"] = run_meta(device, eng, hf_peers={p.name: p.describe(hf) for p in peers})
        res["layer_ops"] = res["meta"]["engine"].get("layer_ops", {}).get("chosen")
        save()
        for batch in args.batches:
            row = add_roofline(decode_case(eng, hf, peers, batch, args, device), wbytes, kv_tok, bw, spec_bw)
            res["decode"].append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("rounds_s")}), flush=True)
            save()
        if args.prefill.lower() != "none":
            res["prefill"] = prefill_case(eng, hf, args.prefill, args.repeats, device)
    res["meta"]["hf_peers"] = {p.name: p.describe(hf) for p in peers}  # again: whether a compile ran is known now
    res["complete"] = True
    save()
    print(table(res))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
