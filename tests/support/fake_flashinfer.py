"""A stand-in for FlashInfer's paged wrappers on CPU, so the FlashInfer backend's own logic
(page tables, plans, the CUDA-graph buffers) is tested without a GPU.

It keeps FlashInfer 0.7's documented contract, from its source: the constructor and `plan`
signatures, fixed buffers under `use_cuda_graph` (plan copies into them, run reads only them),
the head dims and dtypes its kernels exist for, and attention computed from the planned
(indptr, indices, last_page_len) alone, with the causal mask aligned bottom-right. `run`
computes that attention densely; a wrong page table gives wrong outputs, not a crash.
Every plan is recorded in `PLANS` so tests can check what crossed to the device.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from dataclasses import dataclass

import torch

HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)
PLANS: list[Plan] = []


@dataclass
class Plan:
    kind: str
    host_indptr: bool  # indptr and last_page_len handed over on the host (no sync to read them)
    batch: int


def _check(num_qo: int, num_kv: int, head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    if head_dim not in HEAD_DIMS or q_dtype not in DTYPES or kv_dtype not in DTYPES:
        raise RuntimeError(f"Invalid configuration: head_dim {head_dim}, {q_dtype}/{kv_dtype}")
    if num_qo % num_kv:
        raise ValueError("num_qo_heads must be a multiple of num_kv_heads")


def _attend(q: torch.Tensor, k_paged: torch.Tensor, v_paged: torch.Tensor, pages: torch.Tensor, kv_len: int,
            scale: float) -> torch.Tensor:
    """q (n, H, D): the last n of kv_len positions, causal bottom-right."""
    k = k_paged[pages.long()].flatten(0, 1)[:kv_len].float()  # (kv_len, Hkv, D)
    v = v_paged[pages.long()].flatten(0, 1)[:kv_len].float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    n = q.shape[0]
    allowed = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - n, kv_len)[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None) -> None:
        assert kv_layout == "NHD"
        self.graph = use_cuda_graph
        if use_cuda_graph:
            assert paged_kv_indptr_buffer is not None and paged_kv_indices_buffer is not None
            assert paged_kv_last_page_len_buffer is not None
            self.fixed = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != self.fixed + 1:
                raise ValueError("indptr buffer must hold batch_size + 1 entries")
        self.indptr, self.indices, self.last = (
            paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, *, pos_encoding_mode: str = "NONE",
             q_data_type: torch.dtype = torch.float16, kv_data_type: torch.dtype | None = None,
             sm_scale: float | None = None) -> None:
        _check(num_qo_heads, num_kv_heads, head_dim, q_data_type, kv_data_type or q_data_type)
        batch = len(last_page_len)
        PLANS.append(Plan("decode", indptr.device.type == "cpu" and last_page_len.device.type == "cpu", batch))
        if self.graph:
            if batch != self.fixed:
                raise ValueError("The batch size should be fixed in cudagraph mode")
            if len(indices) > len(self.indices):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            self.indptr.copy_(indptr)
            self.last.copy_(last_page_len)
            self.indices[: len(indices)].copy_(indices)
        else:
            self.indptr, self.indices, self.last = indptr.clone(), indices.clone(), last_page_len.clone()
        self.page_size, self.scale = page_size, sm_scale or head_dim**-0.5

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        P, (k, v) = self.page_size, kv
        out = []
        for i in range(q.shape[0]):
            a, b = int(self.indptr[i]), int(self.indptr[i + 1])
            kv_len = (b - a - 1) * P + int(self.last[i])
            out.append(_attend(q[i : i + 1], k, v, self.indices[a:b], kv_len, self.scale))
        return torch.cat(out)


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert kv_layout == "NHD"

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, *, causal: bool = False, sm_scale: float | None = None,
             q_data_type: torch.dtype = torch.float16, kv_data_type: torch.dtype | None = None) -> None:
        _check(num_qo_heads, num_kv_heads, head_dim_qk, q_data_type, kv_data_type or q_data_type)
        assert causal
        host = all(t.device.type == "cpu" for t in (qo_indptr, paged_kv_indptr, paged_kv_last_page_len))
        PLANS.append(Plan("prefill", host, len(paged_kv_last_page_len)))
        self.qo, self.indptr = qo_indptr.clone(), paged_kv_indptr.clone()
        self.indices, self.last = paged_kv_indices.clone(), paged_kv_last_page_len.clone()
        self.page_size, self.scale = page_size, sm_scale or head_dim_qk**-0.5

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        P, (k, v) = self.page_size, kv
        out = []
        for i in range(len(self.last)):
            a, b = int(self.indptr[i]), int(self.indptr[i + 1])
            kv_len = (b - a - 1) * P + int(self.last[i])
            out.append(_attend(q[int(self.qo[i]) : int(self.qo[i + 1])], k, v, self.indices[a:b], kv_len, self.scale))
        return torch.cat(out)


def install(monkeypatch: object) -> types.ModuleType:
    """Make `import flashinfer` return this stand-in for the rest of the test."""
    mod = types.ModuleType("flashinfer")
    mod.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)  # what find_spec reports
    mod.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    mod.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", mod)  # type: ignore[attr-defined]
    PLANS.clear()
    return mod
