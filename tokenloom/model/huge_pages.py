"""Zeroed CPU tensors on transparent huge pages.

Decode attention reads each request's KV blocks wherever its block table puts
them, a few KB here and a few KB there across a cache of GBs. On 4 KB pages
nearly every block is a TLB miss and a page walk before the first byte arrives;
on 2 MB pages the walks mostly go. Kernels commonly run THP in ``madvise`` mode,
where only memory that asks for huge pages gets them, so the KV cache asks:
an anonymous private mapping advised ``MADV_HUGEPAGE``, which the kernel hands
out zeroed (nothing is written here: untouched blocks cost no memory).

Elsewhere (other devices, no ``MADV_HUGEPAGE``, tensors under one huge page)
this is ``torch.zeros``.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, on huge pages where it can be."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if (
        torch.device(device).type != "cpu"
        or nbytes < HUGE_PAGE_BYTES
        or not hasattr(mmap, "MADV_HUGEPAGE")
    ):
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds a reference to the mapping, which lives as long as it does.
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)
