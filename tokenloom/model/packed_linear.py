"""Linear layers with MKL-prepacked weights, for float32 inference on CPU.

MKL can reorder a weight matrix once into the layout its sgemm kernel reads
(``cblas_sgemm_pack``). At decode-sized batches (16-128 rows, the bulk of a
serving workload's steps) the packed GEMM runs up to several times faster than
``F.linear``, which re-packs the weight on every call; the arithmetic, and so
the result, is the same. The original weight stays the module's parameter
(loading, tying and reference comparisons see it unchanged); the packed copy is
a non-persistent buffer.
"""

from __future__ import annotations

import torch
from torch import nn

# Rows MKL is told to expect when packing; the packed layout serves any batch,
# and this hint measured no worse than others from 1 to 512 rows.
_PACK_HINT_ROWS = 128


def prepacking_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True where the packed kernel exists: float32 on a CPU build with MKL."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` through MKL's packed sgemm; same parameters as
    the ``nn.Linear`` (or tied weight) it replaces."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.in_features = weight.shape[1]
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), _PACK_HINT_ROWS)
        self.register_buffer("packed_weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel uses the packed weight only when told the true row count.
        if x.dim() == 2 and x.is_contiguous():  # the decoder's case: no reshaping ops
            return torch.ops.mkl._mkl_linear(
                x, self.packed_weight, self.weight, self.bias, x.shape[0]
            )
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.mkl._mkl_linear(
            rows, self.packed_weight, self.weight, self.bias, rows.shape[0]
        )
        return out.view(*x.shape[:-1], -1)


def prepack_linears(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``module`` by a ``PackedLinear`` sharing
    its parameters; returns how many were replaced."""
    replaced = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            replaced += 1
        else:
            replaced += prepack_linears(child)
    return replaced
