"""Build FlashInfer's JIT modules before anything is timed, so a GPU session can send them back.

FlashInfer compiles each kernel module on first use (20-80 s each). The GPU kit carries some as
AOT modules (bf16, head_dim 32/64); the rest compile on the machine, and gpu_session.sh returns
what compiled (FLASHINFER_WORKSPACE_BASE's cached_ops) in its archive, for the next session's
.gpu-jit/. This builds them on purpose, outside any timed step:

    python bench/jit_warm.py --layer-ops                 # norm, RoPE, SiLU*mul (engine/models/flashinfer_ops.py)
    python bench/jit_warm.py --head-dims 128             # llama-8b-shape's attention kernels

The attention calls mirror the engine's FlashInfer backend (engine/attention/flashinfer_backend.py):
ragged prefill for fresh prompts, paged prefill, and paged decode with and without tensor cores,
causal, no positional encoding in the kernel, bf16 q and KV.
"""

from __future__ import annotations

import argparse
import time

import torch

WORKSPACE_BYTES = 128 << 20


def layer_ops() -> None:
    import flashinfer.activation as act
    import flashinfer.norm as norm
    import flashinfer.rope as rope

    norm.get_norm_module()
    rope.get_rope_module()
    act.get_act_and_mul_module("silu")


def attention(head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype,
              dev: torch.device = torch.device("cuda")) -> None:
    """One plan and run of each wrapper the engine uses, on 16 tokens of one request, page size 1.
    (`dev` is CUDA but for the CPU test, which runs the calls over the FlashInfer stand-in.)"""
    import flashinfer

    n = 16
    ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    q = torch.randn(n, num_heads, head_dim, dtype=dtype, device=dev)
    k, v = (torch.randn(n, num_kv_heads, head_dim, dtype=dtype, device=dev) for _ in range(2))
    qo = torch.tensor([0, n], dtype=torch.int32)
    kw = {"sm_scale": head_dim**-0.5, "q_data_type": dtype, "kv_data_type": dtype}
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    ragged.plan(qo, qo, num_heads, num_kv_heads, head_dim, causal=True, **kw)
    ragged.run(q, k, v)
    pages = (k.view(n, 1, num_kv_heads, head_dim), v.view(n, 1, num_kv_heads, head_dim))
    indptr, indices = qo, torch.arange(n, dtype=torch.int32, device=dev)  # the engine gathers them on the device
    last = torch.ones(1, dtype=torch.int32)
    paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    paged.plan(qo, indptr, indices, last, num_heads, num_kv_heads, head_dim, 1, causal=True, **kw)
    paged.run(q, pages)
    for tensor_cores in (True, False):
        decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
        decode.plan(indptr, indices, last, num_heads, num_kv_heads, head_dim, 1, pos_encoding_mode="NONE", **kw)
        decode.run(q[:1], pages)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer-ops", action="store_true", help="norm, RoPE and SiLU*mul modules")
    ap.add_argument("--head-dims", default="", help="comma-separated head dims whose attention modules to build")
    ap.add_argument("--heads", default="32:8", help="query:KV heads of the attention calls (GQA 4 as Llama 3)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.layer_ops:
        layer_ops()
        print(f"layer-op kernels ready ({time.perf_counter() - t0:.0f}s)", flush=True)
    heads, kv_heads = (int(x) for x in args.heads.split(":"))
    for head_dim in [int(d) for d in args.head_dims.split(",") if d]:
        t = time.perf_counter()
        attention(head_dim, heads, kv_heads, torch.bfloat16)
        print(f"attention kernels for head_dim {head_dim} ready ({time.perf_counter() - t:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
