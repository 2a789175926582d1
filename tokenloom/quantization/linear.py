"""Modules that run on quantized weights: ``QuantLinear`` (every projection and the
LM head) and ``QuantEmbedding`` (dequantizes only the rows it gathers, so a tied
LM head and the embedding share one quantized copy)."""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.model.panel_linear import PanelGather, PanelProjection
from tokenloom.quantization.kernels import native_available, quant_matmul
from tokenloom.quantization.panels import PanelWeight


class QuantLinear(PanelProjection):
    """``y = x @ dequant(weight).T + bias``; activations in float32. Without the
    native kernel (or where the forward plan says matmul=torch) it dequantizes
    per call."""

    # Read by the model's modules, which know no quantized layer by name (LoRA
    # refuses quantized base weights).
    quantized = True

    def __init__(self, weight: PanelWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.in_features, weight.out_features, bias)
        self.qweight = weight

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return quant_matmul(x if x.dtype == torch.float32 else x.float(), self.qweight, self.native)

    def kernel_available(self) -> bool:
        return native_available()

    def silu_product(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.tokenloom_quant.quant_linear_silu(
            x, *self.qweight.kernel_args()
        )
        return out

    def native_projection(self) -> object:
        return torch.classes.tokenloom_quant.QuantProjection(*self.qweight.kernel_args())

    @property
    def weight_bytes(self) -> int:
        return self.qweight.nbytes


class QuantEmbedding(PanelGather):
    """Gathers rows of a quantized [vocab, hidden] matrix as float32: the native
    gather and the torch path compute the same bits (``formats.py``'s
    ``dequantize``)."""

    quantized = True

    def __init__(self, weight: PanelWeight) -> None:
        super().__init__()
        self.qweight = weight

    def kernel_available(self) -> bool:
        return native_available()

    def native_rows(self, ids: torch.Tensor) -> torch.Tensor:
        rows: torch.Tensor = torch.ops.tokenloom_quant.quant_rows(
            ids, *self.qweight.kernel_args(), self.qweight.in_features
        )
        return rows

    def torch_rows(self, flat_ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.dequantize(flat_ids)


def quantized_weight_bytes(module: nn.Module) -> int:
    """Bytes of every quantized weight under ``module`` (shared ones once)."""
    seen = {
        id(m.qweight): m.qweight.nbytes
        for m in module.modules()
        if isinstance(m, (QuantLinear, QuantEmbedding))
    }
    return sum(seen.values())
