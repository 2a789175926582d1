"""Zeroed CPU tensors on transparent huge pages, faulted in up front.

Decode attention reads each request's KV blocks wherever its block table puts
them, a few KB here and a few KB there across a cache of GBs. On 4 KB pages
nearly every block is a TLB miss and a page walk before the first byte arrives;
on 2 MB pages the walks mostly go. Kernels commonly run THP in ``madvise`` mode,
where only memory that asks for huge pages gets them, so the KV cache asks:
an anonymous private mapping advised ``MADV_HUGEPAGE``, which the kernel hands
out zeroed.

The pages are then faulted in (``MADV_POPULATE_WRITE``), as allocating a cache
with ``torch.zeros`` would: left to the first write of each block, the faults
would fall in the first requests' steps, and on a VM whose host backs guest
memory only when it is first touched they are slow enough to make a fresh
engine's first requests slower than its later ones. By default ``zeros``
returns once they are in. A server's engine core calls
``populate_in_background()`` first: it then answers health checks while a
thread faults the pages in (seconds for GBs), and any page a step writes
before that thread reaches it is faulted in by the write, as it would be
without the advice. Faulting in never changes the memory's contents, so the
two may meet. Where the kernel lacks the advice (before Linux 5.14), the pages
come as they are first written.

Elsewhere (other devices, no ``MADV_HUGEPAGE``, tensors under one huge page)
this is ``torch.zeros``.

A batch-1 decode streams every weight matrix from DRAM once per step, and on
4 KB pages the hardware prefetcher stops at every page's end: ``WeightArena``
places weights on huge pages too. Most matrices are smaller than one, so the
arena packs them side by side into shared huge-page chunks; only the pages
written are faulted in, so a chunk's unused end costs no memory.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

HUGE_PAGE_BYTES = 2 << 20
MADV_POPULATE_WRITE = 23  # Linux 5.14; Python's mmap module names it from 3.12 on

# Set by populate_in_background(): the thread that faults pages in, and its work.
_populator: ThreadPoolExecutor | None = None
_pending: list[Future[None]] = []


def populate_in_background() -> None:
    """From now on ``zeros`` returns before its pages are faulted in; a thread does it."""
    global _populator
    if _populator is None:
        _populator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenloom-populate")


def wait_populated() -> None:
    """Return once every page ``zeros`` handed out so far is faulted in."""
    while _pending:
        _pending.pop().result()


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
    memory = _huge_page_mapping(nbytes)
    if _populator is None:
        _populate(memory, nbytes)
    else:
        _pending.append(_populator.submit(_populate, memory, nbytes))
    # The tensor holds a reference to the mapping, which lives as long as it does.
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)


class WeightArena:
    """Copies of CPU tensors placed side by side on huge pages (see the module's
    docstring); a copy keeps its chunk alive as long as it lives."""

    CHUNK_BYTES = 32 << 20
    ALIGN = 64  # a cache line: a matrix's rows start on one

    def __init__(self) -> None:
        self._chunk: mmap.mmap | None = None
        self._used = 0

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``tensor`` in the arena (``tensor`` itself where huge
        pages cannot help: another device, or a kernel without the advice)."""
        if tensor.device.type != "cpu" or tensor.numel() == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        start = (self._used + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        if self._chunk is None or start + nbytes > len(self._chunk):
            whole_pages = (nbytes + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
            self._chunk = _huge_page_mapping(max(self.CHUNK_BYTES, whole_pages))
            start = 0
        self._used = start + nbytes
        placed = torch.frombuffer(
            self._chunk, dtype=tensor.dtype, count=tensor.numel(), offset=start
        ).view(tensor.shape)
        return placed.copy_(tensor)


def _huge_page_mapping(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping of ``nbytes``, advised huge pages."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


@functools.cache
def _madvise() -> Callable[[int, int, int], int]:
    """libc's ``madvise`` (looked up once: an engine populates a cache per layer)."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def _populate(memory: mmap.mmap, nbytes: int) -> None:
    """Faults in every page of ``memory`` for writing, where the kernel can (else
    the pages come as they are first written)."""
    start = ctypes.c_char.from_buffer(memory)
    try:
        _madvise()(ctypes.addressof(start), nbytes, MADV_POPULATE_WRITE)
    finally:
        del start  # a live export would keep the mapping from ever closing
