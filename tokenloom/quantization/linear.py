"""Modules that run on quantized weights: ``QuantLinear`` (every projection and the
LM head) and ``QuantEmbedding`` (dequantizes only the rows it gathers, so a tied
LM head and the embedding share one quantized copy)."""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.quantization.kernels import native_available, quant_matmul
from tokenloom.quantization.panels import PANEL, PanelWeight


class QuantLinear(nn.Module):
    """``y = x @ dequant(weight).T + bias``; activations in float32."""

    # Read by the model's modules, which know no quantized layer by name (LoRA
    # refuses quantized base weights).
    quantized = True

    def __init__(self, weight: PanelWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = weight
        self.bias = bias
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        # The native kernel, where this process has it; else (or where the forward
        # plan says matmul=torch: ``model.panel_linear.use_native_matmul``)
        # dequantize per call.
        self.native = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The decoder's 2-D float32 rows go straight to the kernel, with no op
        # around it: this runs for every projection of every layer each step.
        if x.dim() != 2:
            return self(x.reshape(-1, self.in_features)).view(*x.shape[:-1], -1)
        out = quant_matmul(x if x.dtype == torch.float32 else x.float(), self.qweight, self.native)
        if self.bias is not None:
            out += self.bias
        return out

    @property
    def has_silu_product(self) -> bool:
        """Whether ``silu_product`` runs: the native kernel, no bias, and each half
        of the output whole panels (as the decoder stack's ``has_silu_product``)."""
        return (
            self.native
            and self.bias is None
            and self.out_features % (2 * PANEL) == 0
            and native_available()
        )

    def silu_product(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(y[:, :N / 2]) * y[:, N / 2:]`` of ``y = self(x)`` (2-D ``x``), a
        SwiGLU MLP's activation, computed as the native kernel's output: ``y`` is
        never stored. The same bits as the projection, then layer_ops'
        ``silu_and_mul``. Only where ``has_silu_product``."""
        return torch.ops.tokenloom_quant.quant_linear_silu(x, *self.qweight.kernel_args())

    def native_projection(self) -> object:
        """This projection as the native decoder stack takes it
        (``model.panel_linear.NativeProjection``)."""
        return torch.classes.tokenloom_quant.QuantProjection(*self.qweight.kernel_args())


class QuantEmbedding(nn.Module):
    """Gathers rows of a quantized [vocab, hidden] matrix as float32."""

    quantized = True

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
