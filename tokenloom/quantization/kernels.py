"""The native quantized matmul (``csrc/quantization/quant_linear.cpp``;
``csrc/decoder/decoder_stack.cpp`` runs it for whole decoders), the
``tokenloom_quant`` ops of the native CPU library (``ops.native_library``). It
reads ``panels.py``'s layout, rounds the activations to int8 (a scale per 8 or
16 columns, as the matrix says) and uses integer dot products (AVX-512 VNNI,
AVX-VNNI or AVX2, by the library's variant).
Without the library or with ``TOKENLOOM_CPU_KERNELS=0``, ``quant_matmul``
dequantizes and uses ``F.linear`` instead: float activations, slower, and the
float weights exist for the duration of the call.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tokenloom.ops.native_library import kernels_enabled, load_library
from tokenloom.quantization.panels import PanelWeight


@functools.cache
def native_available() -> bool:
    """Whether the native kernel can be used in this process (decided once: a
    batch-1 step makes about 120 calls)."""
    return kernels_enabled() and load_library() is not None


def quant_matmul(x: torch.Tensor, weight: PanelWeight, native: bool = True) -> torch.Tensor:
    """``x [M, K] float32 @ dequant(weight).T -> [M, N]``."""
    if native and native_available():
        return torch.ops.tokenloom_quant.quant_linear(x, *weight.kernel_args())
    return F.linear(x, weight.dequantize())
