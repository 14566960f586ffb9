"""copy_pages: page-to-page copies between two views of KV pages, as few copies as the
pages allow. The PD roles stage head slices with it (prefill/staging.py gathers a slice into
staging pages, decode/staging.py scatters staged pages into a room's)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.protocol.kv_layout import page_runs

MAX_RUN_COPIES = 8  # more runs than this copy with one indexed gather + scatter instead


def copy_pages(dst: torch.Tensor, dst_pages: Sequence[int], src: torch.Tensor, src_pages: Sequence[int]) -> None:
    """dst[:, :, dst_pages[i]] = src[:, :, src_pages[i]] for every i; dim 2 of both views is
    pages (strided views are fine). One strided copy per run, a single pass over the bytes; a
    scattered set (more than MAX_RUN_COPIES runs) goes through one indexed gather instead."""
    runs = page_runs(src_pages, dst_pages)
    if len(runs) <= MAX_RUN_COPIES:
        for s, d, n in runs:
            dst[:, :, d : d + n].copy_(src[:, :, s : s + n])
        return
    dev = dst.device
    dst[:, :, torch.tensor(list(dst_pages), device=dev)] = src[:, :, torch.tensor(list(src_pages), device=dev)]
