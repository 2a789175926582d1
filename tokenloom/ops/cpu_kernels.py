"""Native CPU kernels, compiled on first use with torch's C++ extension builder.

``bind_threads_to_cores()`` pins torch's intra-op threads to CPUs.
``paged_attention_op()`` returns the ``tokenloom_cpu.paged_attention`` op (see
``csrc/attention/paged_attention.cpp``), and ``layer_ops_available()`` says whether the
fused element-wise layers of ``csrc/layer_ops.cpp`` can be used. Neither can be
had without a C++ compiler, after a failed build, or with
``TOKENLOOM_CPU_KERNELS=0``; callers then use the pure-torch path, which gives
the same results more slowly. The build (about a minute, once
per machine) is cached under ``~/.cache/tokenloom/kernels``; the directory is
keyed by the CPU's model and flags, because the code is compiled for the host
(``-march=native``), and by the checkout whose sources it builds.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# The C++ sources: the repository's csrc/ (includes are relative to it).
CSRC = Path(__file__).resolve().parents[2] / "csrc"
_SOURCES = [CSRC / "attention" / "paged_attention.cpp", CSRC / "layer_ops.cpp"]
_CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffp-contract=fast"]


def kernels_enabled() -> bool:
    return os.environ.get("TOKENLOOM_CPU_KERNELS", "1") != "0"


def build_key(source_dir: Path) -> str:
    """Identifies a build: the host's instruction set (the code is compiled with
    ``-march=native``) and where the sources live, so two checkouts never share a
    build directory (each would rebuild it for its own source paths)."""
    text = platform.machine() + str(source_dir)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        lines = cpuinfo.read_text().splitlines()
        text += "".join(line for line in lines if line.startswith(("model name", "flags")))[:4096]
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def build_extension(name: str, sources: list[Path]) -> bool:
    """Build (or reuse) and load the op library ``name`` from ``sources``, cached under
    ``~/.cache/tokenloom/kernels/<build key>``; False (with a warning) if it fails."""
    from torch.utils import cpp_extension

    build_dir = Path.home() / ".cache" / "tokenloom" / "kernels" / build_key(sources[0].parent)
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(
            name=name,
            sources=[str(source) for source in sources],
            extra_cflags=_CFLAGS,
            extra_include_paths=[str(CSRC)],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("native CPU kernels %s unavailable (%s); using the torch path", name, e)
        return False
    return True


@functools.cache
def _load() -> bool:
    """Build (or reuse) and load the extension once per process; False if it fails."""
    return build_extension("tokenloom_cpu", _SOURCES)


def bind_threads_to_cores() -> list[int] | None:
    """Pin torch's intra-op worker threads one per allowed CPU, as vLLM's CPU backend
    does (the calling thread is left free); returns the CPUs used, or None when the
    kernels are unavailable or there are more threads than CPUs."""
    if not kernels_enabled() or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    if threads > len(cpus) or not _load():
        return None
    torch.ops.tokenloom_cpu.bind_threads(cpus[:threads])
    return cpus[:threads]


# Head sizes the kernel is compiled for (csrc/paged_attention.cpp).
NATIVE_HEAD_DIMS = (32, 64, 80, 96, 128, 256)


def layer_ops_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the native kernels (``torch.ops.tokenloom_cpu``) serve this device and
    dtype: float32 on CPU, kernels enabled and built."""
    return device.type == "cpu" and dtype == torch.float32 and kernels_enabled() and _load()


def paged_attention_op(
    device: torch.device, dtype: torch.dtype, head_dim: int
) -> Callable[..., None] | None:
    """The native paged-attention op for float32 CPU caches, if it can be had."""
    if head_dim not in NATIVE_HEAD_DIMS or not layer_ops_available(device, dtype):
        return None
    op: Callable[..., None] = torch.ops.tokenloom_cpu.paged_attention
    return op
