"""What the native CPU kernels serve, and thread binding through them.

``bind_threads_to_cores()`` pins torch's intra-op threads to CPUs.
``paged_attention_op()`` returns the ``tokenloom_cpu.paged_attention`` op (see
``csrc/attention/paged_attention.cpp``), and ``layer_ops_available()`` says whether the
fused element-wise layers of ``csrc/layer_ops.cpp`` can be used. Neither can be
had without the native library (``native_library``) or with
``TOKENLOOM_CPU_KERNELS=0``; callers then use the pure-torch path, which gives
the same results more slowly.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from tokenloom.ops.native_library import kernels_enabled, load_library

__all__ = [
    "NATIVE_HEAD_DIMS",
    "bind_threads_to_cores",
    "kernels_enabled",
    "layer_ops_available",
    "paged_attention_op",
]


def _loaded() -> bool:
    return load_library() is not None


def bind_threads_to_cores() -> list[int] | None:
    """Pin torch's intra-op worker threads one per allowed CPU, as vLLM's CPU backend
    does (the calling thread is left free); returns the CPUs used, or None when the
    kernels are unavailable or there are more threads than CPUs."""
    if not kernels_enabled() or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    if threads > len(cpus) or not _loaded():
        return None
    torch.ops.tokenloom_cpu.bind_threads(cpus[:threads])
    return cpus[:threads]


# Head sizes the kernel is compiled for (csrc/attention/paged_attention.cpp).
NATIVE_HEAD_DIMS = (32, 64, 80, 96, 128, 256)


def layer_ops_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the native kernels (``torch.ops.tokenloom_cpu``) serve this device and
    dtype: float32 on CPU, kernels enabled and the library loaded."""
    return device.type == "cpu" and dtype == torch.float32 and kernels_enabled() and _loaded()


def paged_attention_op(
    device: torch.device, dtype: torch.dtype, head_dim: int
) -> Callable[..., None] | None:
    """The native paged-attention op for float32 CPU caches, if it can be had."""
    if head_dim not in NATIVE_HEAD_DIMS or not layer_ops_available(device, dtype):
        return None
    op: Callable[..., None] = torch.ops.tokenloom_cpu.paged_attention
    return op
