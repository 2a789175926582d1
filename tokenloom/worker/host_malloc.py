"""Keep glibc malloc from returning the forward pass's buffers to the kernel.

A forward pass allocates and frees the same large activation tensors every
step. With glibc's defaults each one above the (adaptive, at most 32 MiB) mmap
threshold is a fresh ``mmap`` whose pages the kernel must fault in and zero, and
freed heap tops are trimmed back with ``sbrk``: on a small model that kernel
work costs as much CPU time as the model itself. Raising the thresholds keeps
freed memory in the heap for the next step, as a caching allocator does on GPU.

Loading is the opposite case: its temporaries (a GGUF tensor's unpacked codes,
float copies) are freed once, between the weights that stay, and would hold
hundreds of MB of heap. So the runner hands them back with
``release_freed_memory`` (``malloc_trim``) after loading, and only then keeps
freed memory for the steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

# mallopt() parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

_KEEP_BYTES = 1 << 30  # serve allocations up to 1 GiB from the heap, keep 1 GiB freed
_TOP_PAD_BYTES = 64 << 20  # grow the heap in 64 MiB steps


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return None  # musl and others: leave their allocator alone
    return libc


def keep_freed_memory() -> bool:
    """Tune glibc malloc for a step loop; False (and no change) off glibc."""
    libc = _glibc()
    if libc is None:
        return False
    settings = (
        (_M_MMAP_THRESHOLD, _KEEP_BYTES),
        (_M_TRIM_THRESHOLD, _KEEP_BYTES),
        (_M_TOP_PAD, _TOP_PAD_BYTES),
    )
    return all(libc.mallopt(param, value) == 1 for param, value in settings)


def release_freed_memory() -> bool:
    """Return every free page of glibc's heaps to the kernel; False off glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
