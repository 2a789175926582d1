"""Choosing the compute dtype.

``resolve_dtype(name, device) -> torch.dtype``: "auto" picks bfloat16 where the
hardware multiplies it natively (CUDA, or a CPU with AVX512_BF16 / AMX) and
float32 elsewhere, because emulated bf16 matmuls on older CPUs are slower than
fp32 ones. Explicit names are honoured as given.
``resolve_kv_cache_dtype(name, model_dtype, quantized)``: the KV cache's dtype,
"auto" meaning the model's, or bfloat16 for a model on quantized weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")


def cpu_has_native_bf16(cpuinfo: str | None = None, capability: str | None = None) -> bool:
    """True when this CPU has bf16 matmul instructions (AVX512_BF16 or AMX).

    ``cpuinfo`` / ``capability`` default to /proc/cpuinfo and torch's report.
    """
    if capability is None:
        capability = str(torch.backends.cpu.get_cpu_capability())
    if "AMX" in capability.upper() or "BF16" in capability.upper():
        return True
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return any(flag in flags for flag in _BF16_CPU_FLAGS)
    return False


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """Map a ModelConfig.dtype name to a torch dtype for ``device``."""
    if name in _NAMED:
        return _NAMED[name]
    if name != "auto":
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {name!r}")
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_kv_cache_dtype(
    name: str, model_dtype: torch.dtype, quantized: bool = False
) -> torch.dtype:
    """Map a CacheConfig.cache_dtype name to a torch dtype.

    "auto": the model's dtype, except under quantized weights, whose float32 is
    only what their kernels compute in: there bfloat16, as both peers do (vLLM
    runs a GGUF's float32 config in 16 bits, llama.cpp keeps K/V in f16). It
    halves what decode attention reads, and its rounding moves the outputs far
    less than the weights' quantization already has."""
    if name == "auto":
        return torch.bfloat16 if quantized else model_dtype
    if name not in _NAMED:
        raise ValueError(
            f"cache_dtype must be one of auto, float32, bfloat16, float16; got {name!r}"
        )
    return _NAMED[name]
