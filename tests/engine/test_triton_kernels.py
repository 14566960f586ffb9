"""The Triton kernels the engine uses on CUDA, against the torch forms they replace: on CPU
through Triton's interpreter (set before Triton is imported, so in a child process), and on
the GPU.

    attention/page_gather.py   a batch's page table in one launch   (flashinfer_backend.page_indices)
    kvcache/kv_store_triton.py a layer's K and V into the pool      (two index_copy_)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _run_in_child(check: str, device: str) -> None:
    """`check` (a script that prints "same") in a fresh interpreter on `device`."""
    pytest.importorskip("triton")
    env = {**os.environ, **({"TRITON_INTERPRET": "1"} if device == "cpu" else {})}
    out = subprocess.run([sys.executable, "-c", f"DEVICE = {device!r}\n" + check], env=env,
                         capture_output=True, text=True, timeout=300, cwd="/")
    assert out.stdout.strip() == "same", out.stderr[-3000:]


_GATHER_CHECK = """
import torch
from tandem.engine.attention.flashinfer_backend import host_page_counts, page_indices
from tandem.engine.attention.page_gather import BLOCK, gather_page_indices
g = torch.Generator().manual_seed(0)
for page_size in (1, 16):
    table = torch.randint(0, 10_000, (6, BLOCK * 16 + 16), dtype=torch.int32, generator=g).to(DEVICE)
    rows, lens = [4, 0, 2, 0, 5], [37, 1, 1024, 16, BLOCK * page_size + 1]  # a row over one block of pages
    indptr, _ = host_page_counts(lens, page_size)
    args = (table, torch.tensor(rows, device=DEVICE), indptr, int(indptr[-1]), page_size)
    want = page_indices(table, args[1], torch.tensor(lens, dtype=torch.int32, device=DEVICE), *args[3:])
    assert torch.equal(gather_page_indices(*args), want), page_size
assert gather_page_indices(table, torch.tensor([], dtype=torch.int64), torch.tensor([0]), 0, 1).numel() == 0
print("same")
"""


@pytest.mark.parametrize("device", DEVICES)
def test_the_one_launch_page_table_equals_the_torch_one(device: str) -> None:
    _run_in_child(_GATHER_CHECK, device)


_STORE_CHECK = """
import torch
from tandem.engine.kvcache.kv_store_triton import rows_are_dense, store_kv
g = torch.Generator().manual_seed(0)
for heads, dim, dtype in ((2, 64, torch.bfloat16), (8, 128, torch.float16), (1, 32, torch.float32)):
    width = heads * dim
    qkv = torch.randn(9, 3 * width + 5, generator=g).to(dtype).to(DEVICE)  # rows wider than k and v
    k = qkv[:, width : 2 * width].view(9, heads, dim)
    v = qkv[:, 2 * width + 5 :].view(9, heads, dim)
    assert rows_are_dense(k) and rows_are_dense(v) and not k.is_contiguous()
    loc = torch.randperm(40, generator=g)[:9].to(DEVICE)
    kb, vb = (torch.zeros(40, heads, dim, dtype=dtype, device=DEVICE) for _ in range(2))
    want_k, want_v = kb.clone().index_copy_(0, loc, k), vb.clone().index_copy_(0, loc, v)
    store_kv(kb, vb, loc, k, v)
    assert torch.equal(kb, want_k) and torch.equal(vb, want_v), (heads, dim, dtype)
store_kv(kb, vb, loc[:0], k[:0], v[:0])
assert not rows_are_dense(torch.randn(4, 8, 2).transpose(1, 2))
print("same")
"""


@pytest.mark.parametrize("device", DEVICES)
def test_the_one_launch_kv_store_equals_index_copy(device: str) -> None:
    """From k/v that are strided views of wider rows, as the forward's qkv are."""
    _run_in_child(_STORE_CHECK, device)
