"""The native quantized matmul (``csrc/quantization/quant_linear.cpp``; ``csrc/quantization/decoder_stack.cpp``
runs it for whole decoders), built on first use as their own extension
``tokenloom_quant`` (cached like ``model.cpu_kernels``'s, keyed by
the CPU's flags and this checkout). It reads ``panels.py``'s layout, rounds the
activations to int8 (a scale per 8 or 16 columns, as the matrix says) and uses
integer dot products (AVX-512 VNNI, AVX-VNNI or AVX2).
Without AVX2 or a compiler, after a failed build or with
``TOKENLOOM_CPU_KERNELS=0``, ``quant_matmul`` dequantizes and uses ``F.linear``
instead: float activations, slower, and the float weights exist for the
duration of the call.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tokenloom.ops.cpu_kernels import CSRC, build_extension, kernels_enabled
from tokenloom.quantization.panels import PanelWeight

_SOURCES = [CSRC / "quantization" / name for name in ("quant_linear.cpp", "decoder_stack.cpp")]


@functools.cache
def native_available() -> bool:
    """Whether the native kernel can be used in this process (decided once: a
    batch-1 step makes about 120 calls)."""
    return kernels_enabled() and build_extension("tokenloom_quant", _SOURCES)


def quant_matmul(x: torch.Tensor, weight: PanelWeight, native: bool = True) -> torch.Tensor:
    """``x [M, K] float32 @ dequant(weight).T -> [M, N]``."""
    if native and native_available():
        return torch.ops.tokenloom_quant.quant_linear(x, *weight.kernel_args())
    return F.linear(x, weight.dequantize())
