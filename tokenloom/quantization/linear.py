"""Modules that run on quantized weights: ``QuantLinear`` (every projection and the
LM head) and ``QuantEmbedding`` (dequantizes only the rows it gathers, so a tied
LM head and the embedding share one quantized copy)."""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.quantization.kernels import quant_matmul
from tokenloom.quantization.panels import PanelWeight


class QuantLinear(nn.Module):
    """``y = x @ dequant(weight).T + bias``; activations in float32."""

    def __init__(self, weight: PanelWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = weight
        self.bias = bias
        self.in_features = weight.in_features
        self.out_features = weight.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The decoder's 2-D float32 rows go straight to the kernel: at batch 1 a
        # step makes ~120 of these calls, and each extra op costs microseconds.
        if x.dim() != 2:
            return self(x.reshape(-1, self.in_features)).view(*x.shape[:-1], -1)
        out = quant_matmul(x if x.dtype == torch.float32 else x.float(), self.qweight)
        if self.bias is not None:
            out += self.bias
        return out


class QuantEmbedding(nn.Module):
    """Gathers rows of a quantized [vocab, hidden] matrix as float32."""

    def __init__(self, weight: PanelWeight) -> None:
        super().__init__()
        self.qweight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.qweight.dequantize(flat).view(*ids.shape, -1)


def quantized_weight_bytes(module: nn.Module) -> int:
    """Bytes of every quantized weight under ``module`` (shared ones once)."""
    seen = {
        id(m.qweight): m.qweight.nbytes
        for m in module.modules()
        if isinstance(m, (QuantLinear, QuantEmbedding))
    }
    return sum(seen.values())
