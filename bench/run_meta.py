"""What ran, recorded beside every benchmark's figures: the `meta` key of each result JSON.

A figure is only comparable with another when both say what produced them. The first GPU
run's JSONs did not: which layer ops ran (layer_ops=auto keeps the torch chain when FlashInfer's
kernels fail their warm-up, with nothing but a log line to say so), which attention kernel,
which FlashInfer. Here every run records:

- the engine, when there is one: the layer ops requested, planned and chosen (a fallback is
  `fell_back: true` and a warning on stderr), the attention backend and its decode kernel
  (tensor cores or CUDA cores), ragged prefill, CUDA graphs, page size, dtype, the KV pool and
  the whole resolved EngineConfig;
- the environment: torch/transformers/triton/FlashInfer/NIXL/xgrammar versions (None where
  absent), CUDA, the GPU's name or the CPU's model, the git commit when the tree has one (the
  GPU machine gets a copy without .git: TANDEM_COMMIT says it there) and a digest of the
  sources, which identifies the code either way.

    python bench/run_meta.py --device cuda --out env.json     # the environment alone
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from tandem.loadgen.cli import cpu_name

ROOT = Path(__file__).resolve().parent.parent
# Distributions whose versions a result depends on; the first installed name of each entry counts.
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",), "transformers": ("transformers",), "triton": ("triton",),
    "flashinfer": ("flashinfer-python", "flashinfer"), "nixl": ("nixl-cu13", "nixl-cu12", "nixl"),
    "xgrammar": ("xgrammar",), "safetensors": ("safetensors",),
}
# Where the code lives: the digest covers these folders' sources, so two runs of the same tree
# agree on it with or without git.
SOURCE_DIRS = ("tandem", "engine", "prefill", "decode", "router", "bench")
SOURCE_SUFFIXES = (".py", ".sh", ".cpp", ".h", ".cu")


def _version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    """Package versions, None for what is not installed. The GPU kit unpacks FlashInfer onto
    PYTHONPATH without its dist-info, so its module's own __version__ is the fallback."""
    out = {key: _version(names) for key, names in DISTRIBUTIONS.items()}
    if out["flashinfer"] is None and importlib.util.find_spec("flashinfer") is not None:
        try:
            import flashinfer

            out["flashinfer"] = getattr(flashinfer, "__version__", "unknown")
        except Exception as exc:  # a broken install is itself worth recording
            out["flashinfer"] = f"import failed: {type(exc).__name__}"
    out["python"] = platform.python_version()
    out["cuda"] = torch.version.cuda
    return out


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model and the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()} ({torch.get_num_threads()} threads)"


def source_digest() -> str:
    h = hashlib.sha256()
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(ROOT)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def git_commit() -> str | None:
    """HEAD (with `-dirty` for uncommitted changes), TANDEM_COMMIT where the tree has no .git."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("TANDEM_COMMIT") or None


def environment(device: torch.device) -> dict[str, Any]:
    return {"device": device.type, "device_name": device_name(device), "versions": versions(),
            "git_commit": git_commit(), "source_digest": source_digest(), "argv": sys.argv,
            "cpu": cpu_name(), "hostname": platform.node()}


def _decode_kernel(runner: Any) -> str | None:
    """FlashInfer's decode kernel for this runner (its backend's own rule), None for other backends."""
    if type(runner.attn_backend).__name__ != "FlashInferAttentionBackend":
        return None
    from tandem.engine.attention.flashinfer_backend import decode_tensor_cores

    return "tensor_cores" if decode_tensor_cores(runner) else "cuda_cores"


def layer_ops(runner: Any) -> dict[str, Any]:
    """Requested (the config), planned (what the choice rule picks on this machine) and chosen
    (what runs): planned != chosen is the silent fallback of layer_ops=auto made visible."""
    choose = getattr(runner, "_choose_layer_ops", None)
    planned = choose() if callable(choose) else None
    chosen = runner.layer_ops_name
    return {"requested": runner.config.layer_ops, "planned": planned, "chosen": chosen,
            "fell_back": planned is not None and planned != chosen}


def runner_meta(runner: Any) -> dict[str, Any]:
    backend = runner.attn_backend
    graphs = getattr(runner, "graph_runner", None)
    return {"layer_ops": layer_ops(runner), "attention_backend": type(backend).__name__,
            "decode_kernel": _decode_kernel(runner), "ragged_prefill": hasattr(backend, "ragged_wrapper"),
            "cuda_graphs": graphs is not None, "graph_buckets": list(graphs.buckets) if graphs is not None else None,
            "page_size": runner.page_size, "dtype": str(runner.dtype).removeprefix("torch."),
            "device": str(runner.device), "kv_pool_tokens": runner.kv_pool.capacity_tokens}


def engine_meta(eng: Any) -> dict[str, Any]:
    """What an in-process Engine runs; warns on stderr when its layer ops fell back."""
    out: dict[str, Any] = {"engine_config": dataclasses.asdict(eng.config)}
    try:
        runner = eng.scheduler.runner
    except RuntimeError as exc:  # dp_size > 1: the runners live in other processes
        return {**out, "runner": None, "why": str(exc)}
    out |= runner_meta(runner)
    ops = out["layer_ops"]
    if ops["fell_back"]:
        print(f"WARNING: layer ops fell back: requested {ops['requested']}, planned {ops['planned']}, "
              f"ran {ops['chosen']} (see the engine's log for the failed warm-up)", file=sys.stderr, flush=True)
    return out


def run_meta(device: torch.device, eng: Any = None, **extra: Any) -> dict[str, Any]:
    """The `meta` of a result: the environment, the engine when there is one, and `extra`."""
    meta: dict[str, Any] = {"environment": environment(device), **extra}
    if eng is not None:
        meta["engine"] = engine_meta(eng)
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    text = json.dumps(run_meta(device), indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
