"""Choosing the dtype a model's weights are kept in, and its KV cache's.

``resolve_dtype(name, device, checkpoint) -> ResolvedDtype``: the weights' dtype
and why. "auto" keeps the checkpoint's own dtype (vLLM's meaning), except where
the hardware cannot compute in it: on a CPU, bfloat16 needs bf16 dot products
(AVX512_BF16 or AMX) or a matmul that widens bfloat16 weights to float32 per
tile (the native dense kernel, ``widens_bf16``: the products of float32
arithmetic, from half the bytes), else float32; float16 needs float16
arithmetic (AVX512_FP16 or AMX-FP16), else it becomes bfloat16 where the CPU
multiplies that (or float32). A checkpoint that does not say its dtype (a
GGUF's dequantized weights) gets bfloat16 where the CPU multiplies it, else
float32. On CUDA, a 16-bit dtype the GPU has. Explicit names are honoured, but
for float16 on a CPU without float16 arithmetic, which is converted to bfloat16
at load as vLLM does: emulated float16 matmuls are many times slower.

What the activations compute in is the forward plan's (``model_loader``): float32
around the native kernels, whatever the weights.

``resolve_kv_cache_dtype(name, weights_dtype, quantized)``: the KV cache's dtype,
"auto" meaning the weights' dtype, or bfloat16 for a model on quantized weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
_FP16_CPU_FLAGS = ("avx512_fp16", "amx_fp16")


class ResolvedDtype(NamedTuple):
    dtype: torch.dtype
    why: str  # for the log: how "auto" or a conversion chose it


def _cpu_flags(cpuinfo: str | None) -> set[str]:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_native_bf16(cpuinfo: str | None = None, capability: str | None = None) -> bool:
    """True when this CPU has bf16 matmul instructions (AVX512_BF16 or AMX).

    ``cpuinfo`` / ``capability`` default to /proc/cpuinfo and torch's report.
    """
    if capability is None:
        capability = str(torch.backends.cpu.get_cpu_capability())
    if "AMX" in capability.upper() or "BF16" in capability.upper():
        return True
    return any(flag in _cpu_flags(cpuinfo) for flag in _BF16_CPU_FLAGS)


def cpu_has_native_fp16(cpuinfo: str | None = None) -> bool:
    """True when this CPU has float16 arithmetic (AVX512_FP16 or AMX-FP16)."""
    return any(flag in _cpu_flags(cpuinfo) for flag in _FP16_CPU_FLAGS)


def resolve_dtype(
    name: str, device: str, checkpoint: str | None = None, widens_bf16: bool = False
) -> ResolvedDtype:
    """The dtype to keep the weights in, for a ModelConfig.dtype ``name`` on
    ``device``; ``checkpoint`` is the dtype the checkpoint says it stores;
    ``widens_bf16``: this model's matmul keeps bfloat16 weights and widens them to
    float32 in registers (the native dense kernel)."""
    if name != "auto" and name not in _NAMED:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {name!r}")
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda:
        bf16 = torch.cuda.is_bf16_supported()
        if name != "auto":
            return ResolvedDtype(_NAMED[name], "as given")
        if checkpoint == "float16" or not bf16:
            return ResolvedDtype(torch.float16, "the GPU's 16-bit dtype")
        return ResolvedDtype(torch.bfloat16, "the GPU's 16-bit dtype")
    bf16, fp16 = cpu_has_native_bf16(), cpu_has_native_fp16()
    no_bf16 = "this CPU has no bfloat16 dot products (AVX512_BF16 or AMX)"
    if name == "float16" and not fp16:
        why = "this CPU has no float16 arithmetic (AVX512_FP16 or AMX-FP16): converted at load"
        return ResolvedDtype(torch.bfloat16, why)
    if name != "auto":
        return ResolvedDtype(_NAMED[name], "as given")
    if checkpoint == "float32":
        return ResolvedDtype(torch.float32, "the checkpoint's dtype")
    if checkpoint == "bfloat16":
        if bf16:
            return ResolvedDtype(torch.bfloat16, "the checkpoint's dtype")
        if widens_bf16:
            why = f"the checkpoint's dtype; {no_bf16}: widened to float32 per tile"
            return ResolvedDtype(torch.bfloat16, why)
        return ResolvedDtype(torch.float32, f"the checkpoint's bfloat16, but {no_bf16}")
    if checkpoint == "float16":
        if fp16:
            return ResolvedDtype(torch.float16, "the checkpoint's dtype")
        if bf16:
            why = "the checkpoint's float16, converted: this CPU has no float16 arithmetic"
            return ResolvedDtype(torch.bfloat16, why)
        return ResolvedDtype(torch.float32, f"the checkpoint's float16, but {no_bf16}")
    said = f"the checkpoint says {checkpoint}" if checkpoint else "the checkpoint names no dtype"
    if bf16:
        return ResolvedDtype(torch.bfloat16, f"{said}; this CPU multiplies bfloat16")
    return ResolvedDtype(torch.float32, f"{said}; {no_bf16}")


def resolve_kv_cache_dtype(
    name: str, weights_dtype: torch.dtype, quantized: bool = False
) -> torch.dtype:
    """Map a CacheConfig.cache_dtype name to a torch dtype.

    "auto": the weights' dtype, except under quantized weights, whose float32 is
    only what their kernels compute in: there bfloat16, as both peers do (vLLM
    runs a GGUF's float32 config in 16 bits, llama.cpp keeps K/V in f16). It
    halves what decode attention reads, and its rounding moves the outputs far
    less than the weights' quantization already has."""
    if name == "auto":
        return torch.bfloat16 if quantized else weights_dtype
    if name not in _NAMED:
        raise ValueError(
            f"cache_dtype must be one of auto, float32, bfloat16, float16; got {name!r}"
        )
    return _NAMED[name]
