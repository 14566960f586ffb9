"""A stand-in for FlashInfer's paged wrappers (and, in fake_flashinfer_ops.py, its norm, RoPE and
activation kernels) on CPU, so the FlashInfer backend's own logic
(page tables, plans, the CUDA-graph buffers) is tested without a GPU.

It keeps FlashInfer 0.7's contract, from its source, and is no more permissive than it:
- the constructor and `plan` signatures; fixed buffers under `use_cuda_graph` (plan copies into
  them, run reads only them); the head dims and dtypes its kernels exist for; int32 index tables.
- decode's split-KV arguments: `fixed_split_size` only with tensor cores, as FlashInfer checks;
  `disable_split_kv` may not change between plans of one tensor-core graph wrapper (FlashInfer
  would replay the captured form over the other plan).
- `run` refuses what FlashInfer refuses: q or KV dtypes other than the planned `q_data_type` and
  `kv_data_type`, q rows other than `qo_indptr[-1]` (prefill) or the batch size (decode), and
  heads, head_dim or page size other than the planned ones. Every kernel reads q, k and v through
  their row and head strides (a contiguous last dim); the prefill wrappers, which Hopper runs on
  FA3's TMA loads, also need 16-byte aligned addresses and strides.
- outside CUDA-graph mode the index tensors are the caller's, by reference, as FlashInfer keeps
  device tensors: a caller that overwrites them between plan and run changes what run reads.
- plan's copies to the device are asynchronous (fake_flashinfer_copies.py): host inputs changed
  before their copy landed, or a re-plan before the previous plan's copy landed, are errors.
`run` computes attention densely from the planned (indptr, indices, last_page_len) alone, causal
mask aligned bottom-right; a wrong page table gives wrong outputs, not a crash. Every plan is
recorded in `PLANS` so tests can check what crossed to the device.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from dataclasses import dataclass

import fake_flashinfer_copies as copies
import fake_flashinfer_ops
import torch

HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)
PLANS: list[Plan] = []


@dataclass
class Plan:
    kind: str
    host_indptr: bool  # indptr and last_page_len handed over on the host (no sync to read them)
    batch: int
    split_kv_off: bool = False  # decode's disable_split_kv


def _check(num_qo: int, num_kv: int, head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
           tables: dict[str, torch.Tensor]) -> None:
    if head_dim not in HEAD_DIMS or q_dtype not in DTYPES or kv_dtype not in DTYPES:
        raise RuntimeError(f"Invalid configuration: head_dim {head_dim}, {q_dtype}/{kv_dtype}")
    if num_qo % num_kv:
        raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
    for name, t in tables.items():
        if t.dtype != torch.int32:  # the kernels' IdType; FlashInfer checks it, never casts
            raise ValueError(f"{name} must be int32, got {t.dtype}")


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


class _Paged:
    """What both wrappers share: the planned problem that run checks its inputs against, and the
    pinned buffer through which each plan reaches the device."""

    _tma = False  # the prefill wrappers: FA3 on Hopper reads q, k, v through TMA descriptors

    def __init__(self) -> None:
        self._pinned = copies.PinnedPlan()
        self._copy: copies.PendingCopy | None = None

    def _plan(self, host: dict[str, torch.Tensor], indices: torch.Tensor, heads: tuple[int, int, int],
              page_size: int, q_dtype: torch.dtype, kv_dtype: torch.dtype | None, sm_scale: float | None) -> None:
        kv_dtype = kv_dtype or q_dtype
        _check(*heads, q_dtype, kv_dtype, {**host, "indices": indices})
        self._heads, self._page_size, self._dtypes = heads, page_size, (q_dtype, kv_dtype)
        self._scale = sm_scale or heads[2] ** -0.5
        self._copy = self._pinned.replan(host)

    def _check_run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], rows: int,
                   rows_are: str) -> copies.PendingCopy:
        if self._copy is None:
            raise RuntimeError("run() before plan()")
        (k, v), (q_dtype, kv_dtype), (heads, kv_heads, dim) = kv, self._dtypes, self._heads
        if q.dtype != q_dtype:
            raise ValueError(f"The dtype of q {q.dtype} does not match the q_data_type {q_dtype} "
                             "specified in plan function.")
        if k.dtype != kv_dtype or v.dtype != kv_dtype:
            raise ValueError(f"The dtype of k {k.dtype} / v {v.dtype} does not match the kv_data_type "
                             f"{kv_dtype} specified in plan function.")
        if q.shape[0] != rows:
            raise ValueError(f"q.shape[0] ({q.shape[0]}) does not match {rows_are} ({rows}).")
        if q.dim() != 3 or tuple(q.shape[1:]) != (heads, dim):
            raise ValueError(f"q has shape {tuple(q.shape)}; plan() was given {heads} heads of dim {dim}.")
        kv_shape = (self._page_size, kv_heads, dim) if self._page_size else (kv_heads, dim)  # paged | ragged
        if k.dim() != 1 + len(kv_shape) or tuple(k.shape[1:]) != kv_shape or v.shape != k.shape:
            raise ValueError(f"k/v have shapes {tuple(k.shape)}/{tuple(v.shape)}; plan() was given "
                             f"{kv_heads} KV heads of dim {dim} (NHD), page_size {self._page_size} (0: ragged).")
        if any(t.stride(-1) != 1 for t in (q, k, v)):
            raise ValueError("q, k and v must be contiguous in their last dim")
        if self._tma and any(t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1])
                             for t in (q, k, v)):
            # Hopper runs the prefill wrappers on FA3, which loads q (and ragged k/v) by TMA from
            # their strides (csrc/batch_prefill_sm90.cu): a descriptor needs 16-byte strides.
            raise ValueError("q, k and v need 16-byte aligned addresses and strides (FA3's TMA)")
        self._copy.check("between plan() and run()")
        self._copy.ran = True
        return self._copy

    def _attend_all(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], qo: list[int],
                    indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        P, (k, v) = self._page_size, kv
        if len(indices) < int(indptr[len(qo) - 1]):
            raise RuntimeError(f"paged_kv_indices holds {len(indices)} pages, indptr names "
                               f"{int(indptr[len(qo) - 1])}: the kernel would read past it")
        out = []
        for i in range(len(qo) - 1):
            a, b = int(indptr[i]), int(indptr[i + 1])
            kv_len = (b - a - 1) * P + int(last[i])
            out.append(_attend(q[qo[i] : qo[i + 1]], k, v, indices[a:b], kv_len, self._scale))
        return torch.cat(out)


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None) -> None:
        super().__init__()
        assert kv_layout == "NHD"
        self.workspace = workspace
        self.graph = use_cuda_graph
        self.tensor_cores = use_tensor_cores
        self._frozen_split: bool | None = None
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
             sm_scale: float | None = None, fixed_split_size: int | None = None,
             disable_split_kv: bool = False) -> None:
        if len(indptr) != len(last_page_len) + 1:
            raise ValueError(f"indptr holds {len(indptr)} entries for a batch of {len(last_page_len)}")
        if fixed_split_size is not None and not self.tensor_cores:
            raise ValueError("fixed_split_size is only supported by tensor core decode for now.")
        self._plan_decode("decode", indptr, indices, last_page_len, (num_qo_heads, num_kv_heads, head_dim),
                          page_size, q_data_type, kv_data_type, sm_scale, disable_split_kv)
        if self.graph:  # stream-ordered copies into the fixed buffers the graph reads
            self.indptr.copy_(indptr)
            self.last.copy_(last_page_len)
            self.indices[: len(indices)].copy_(indices)
        else:
            self.indices = indices  # the caller's tensor, not a copy

    def _plan_decode(self, kind: str, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
                     heads: tuple[int, int, int], page_size: int, q_dtype: torch.dtype,
                     kv_dtype: torch.dtype | None, sm_scale: float | None, disable_split_kv: bool) -> None:
        """What a full plan and the fast re-plan share: the fixed batch and buffer checks, the plan."""
        batch = len(last_page_len)
        if self.graph:
            if batch != self.fixed:
                raise ValueError("The batch size should be fixed in cudagraph mode")
            if len(indices) > len(self.indices):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            # Stricter than FlashInfer, whose tensor-core graph would replay the kernels captured
            # (split and merge, or one pass) over a plan of the other form without a word.
            if self.tensor_cores and self._frozen_split not in (None, disable_split_kv):
                raise ValueError("disable_split_kv changed between plans of one cudagraph wrapper")
            self._frozen_split = disable_split_kv
        self._plan({"indptr": indptr, "last_page_len": last_page_len}, indices, heads, page_size, q_dtype,
                   kv_dtype, sm_scale)
        PLANS.append(Plan(kind, indptr.device.type == "cpu" and last_page_len.device.type == "cpu", batch,
                          disable_split_kv))
        self.batch = batch

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        copy = self._check_run(q, kv, self.batch, "the batch size planned")
        if not self.graph:
            return self._attend_all(q, kv, list(range(self.batch + 1)), copy.host["indptr"], self.indices,
                                    copy.host["last_page_len"])
        # The kernels split their work by the plan's host lengths and read the fixed buffers: a
        # buffer that disagrees with the plan is a silent wrong answer on a GPU, an error here.
        if not (torch.equal(self.indptr.cpu(), copy.host["indptr"].cpu())
                and torch.equal(self.last.cpu(), copy.host["last_page_len"].cpu())):
            raise RuntimeError("the fixed indptr / last_page_len buffers disagree with the plan")
        return self._attend_all(q, kv, list(range(self.batch + 1)), self.indptr, self.indices, self.last)


def fast_decode_plan(self: BatchDecodeWithPagedKVCacheWrapper, indptr: torch.Tensor, indices: torch.Tensor,
                     last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                     page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
                     logits_soft_cap: float | None = None, q_data_type: torch.dtype | None = None,
                     kv_data_type: torch.dtype | None = None, data_type: torch.dtype | None = None,
                     sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
                     non_blocking: bool = True, fixed_split_size: int | None = None,
                     disable_split_kv: bool = False, q_len_per_req: int = 1,
                     global_override_indptr_cpu: torch.Tensor | None = None) -> None:
    """flashinfer.decode.fast_decode_plan (0.7): the schedule from host indptr / last_page_len, reusing
    the module a full plan() built (none before one: the real one reads `_cached_module`); under
    CUDA graphs it copies NOTHING into the fixed buffers, which the caller fills on the device."""
    if getattr(self, "_copy", None) is None:
        raise AttributeError("'BatchDecodeWithPagedKVCacheWrapper' object has no attribute '_cached_module'")
    self._plan_decode("fast-decode", indptr, indices, last_page_len, (num_qo_heads, num_kv_heads, head_dim),
                      page_size, q_data_type or torch.float16, kv_data_type, sm_scale, disable_split_kv)
    if not self.graph:
        self.indices = indices


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    _tma = True

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD") -> None:
        super().__init__()
        assert kv_layout == "NHD"
        self.workspace = workspace

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, *, causal: bool = False, sm_scale: float | None = None,
             q_data_type: torch.dtype = torch.float16, kv_data_type: torch.dtype | None = None) -> None:
        assert causal
        batch = len(qo_indptr) - 1
        if len(paged_kv_indptr) != batch + 1 or len(paged_kv_last_page_len) != batch:
            raise ValueError("qo_indptr, paged_kv_indptr and paged_kv_last_page_len disagree on the batch size")
        host = {"qo_indptr": qo_indptr, "paged_kv_indptr": paged_kv_indptr,
                "paged_kv_last_page_len": paged_kv_last_page_len}
        self._plan(host, paged_kv_indices, (num_qo_heads, num_kv_heads, head_dim_qk), page_size,
                   q_data_type, kv_data_type, sm_scale)
        PLANS.append(Plan("prefill", all(t.device.type == "cpu" for t in host.values()), batch))
        self._qo_last = int(qo_indptr[-1])  # read on the host at plan time, as FlashInfer does
        self._indices = paged_kv_indices  # the caller's tensor, not a copy

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        copy = self._check_run(q, kv, self._qo_last, "qo_indptr[-1]")
        qo = [int(x) for x in copy.host["qo_indptr"]]
        return self._attend_all(q, kv, qo, copy.host["paged_kv_indptr"], self._indices,
                                copy.host["paged_kv_last_page_len"])


class BatchPrefillWithRaggedKVCacheWrapper(_Paged):
    """Causal prefill over the caller's own k/v, (tokens, kv_heads, dim) each, no page table.
    run() refuses q or k rows other than qo_indptr[-1] / kv_indptr[-1]; k and v may be strided
    (the kernels take row and head strides), with a contiguous last dim."""

    _tma = True

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD") -> None:
        super().__init__()
        assert kv_layout == "NHD"
        self.workspace = workspace

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim_qk: int, *, causal: bool = False, sm_scale: float | None = None,
             q_data_type: torch.dtype = torch.float16, kv_data_type: torch.dtype | None = None) -> None:
        assert causal
        if len(kv_indptr) != len(qo_indptr):
            raise ValueError("qo_indptr and kv_indptr disagree on the batch size")
        host = {"qo_indptr": qo_indptr, "kv_indptr": kv_indptr}
        self._plan(host, torch.zeros(0, dtype=torch.int32), (num_qo_heads, num_kv_heads, head_dim_qk), 0,
                   q_data_type, kv_data_type, sm_scale)
        PLANS.append(Plan("ragged", all(t.device.type == "cpu" for t in host.values()), len(qo_indptr) - 1))
        self._qo_last, self._kv_last = int(qo_indptr[-1]), int(kv_indptr[-1])

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        copy = self._check_run(q, (k, v), self._qo_last, "qo_indptr[-1]")
        if k.shape[0] != self._kv_last:
            raise ValueError(f"k.shape[0] ({k.shape[0]}) does not match kv_indptr[-1] ({self._kv_last}).")
        qo, kv = ([int(x) for x in copy.host[name]] for name in ("qo_indptr", "kv_indptr"))
        out = []
        for i in range(len(qo) - 1):
            pages = torch.arange(kv[i], kv[i + 1])  # each K/V row a page of one token
            out.append(_attend(q[qo[i] : qo[i + 1]], k[:, None], v[:, None], pages, kv[i + 1] - kv[i], self._scale))
        return torch.cat(out)


def install(monkeypatch: object) -> types.ModuleType:
    """Make `import flashinfer` return this stand-in, and CPU events the fence of its plan copies,
    for the rest of the test."""
    mod = types.ModuleType("flashinfer")
    mod.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)  # what find_spec reports
    mod.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    mod.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    mod.BatchPrefillWithRaggedKVCacheWrapper = BatchPrefillWithRaggedKVCacheWrapper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", mod)  # type: ignore[attr-defined]
    decode = types.ModuleType("flashinfer.decode")
    decode.fast_decode_plan = fast_decode_plan  # type: ignore[attr-defined]
    decode.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    for name, sub in {**fake_flashinfer_ops.modules(), "decode": decode}.items():  # norm, rope, activation, decode
        setattr(mod, name, sub)
        monkeypatch.setitem(sys.modules, f"flashinfer.{name}", sub)  # type: ignore[attr-defined]
    copies.install(monkeypatch)
    PLANS.clear()
    return mod
