"""Float weights (bfloat16 or float32) in panel order, for the native dense kernel
(``csrc/dense/dense_linear.cpp``): the forward plan's ``matmul=native`` for float
weights on the CPU.

The kernel reads a [N, K] matrix as panels of 16 output rows, each row's 4-byte
words side by side (``pack_panels``: [ceil(N / 16), words, 16, E], E = 2 bfloat16
or 1 float32 per word), so one 64-byte load holds a word of 16 rows, as the
quantized kernel reads its panels. Packing is a transpose done once at load; the
weights keep their dtype (a bfloat16 model stays 2 bytes a weight), and the
original layout is not kept: ``PanelEmbedding`` gathers its rows from the panels,
so a tied LM head and the embedding share one copy.

Activations are float32 in and out. bfloat16 weights multiply the activations
rounded to bfloat16 where the CPU has AVX512_BF16 (``vdpbf16ps``, as oneDNN does),
else float32 activations against weights widened in registers
(``dense_bf16_dot_products`` says which this library does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.model.huge_pages import WeightArena

PANEL = 16  # output rows per panel
_WORD_BYTES = 4
# The dtypes the kernel keeps weights in.
PANEL_DTYPES = (torch.bfloat16, torch.float32)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), ceil(K / E), 16, E] (E elements per 4-byte word),
    padded with zero rows and columns."""
    if weight.dtype not in PANEL_DTYPES:
        raise ValueError(f"panels hold bfloat16 or float32 weights, not {weight.dtype}")
    per_word = _WORD_BYTES // weight.element_size()
    n, k = weight.shape
    padded = F.pad(weight, (0, -k % per_word, 0, -n % PANEL))
    panels = padded.view(-1, PANEL, padded.shape[1] // per_word, per_word)
    return panels.transpose(1, 2).contiguous()


def unpack_rows(panels: torch.Tensor, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``pack_panels``' inverse: rows ``rows`` (every row if None, padding included)
    as [len, k]."""
    if rows is None:
        whole = panels.transpose(1, 2).reshape(-1, panels.shape[1] * panels.shape[3])
        return whole[:, :k]
    picked = panels[rows // PANEL, :, rows % PANEL]  # [len, words, E]
    return picked.reshape(rows.shape[0], -1)[:, :k]


class PanelProjection(nn.Module):
    """``y = x @ W.T + bias`` with float32 activations, over a weight in panels of
    ``PANEL`` output rows whatever its format: ``PanelLinear`` (float weights) and
    quantization's ``QuantLinear`` say how to multiply (``matmul``), this class what
    a projection module does around it.

    ``native`` (the forward plan's matmul, see ``use_native_matmul``): the native
    kernel; else the subclass's torch path."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.bias = bias
        self.in_features = in_features
        self.out_features = out_features
        self.native = True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for 2-D float32 ``x``, natively or not as ``native`` says."""
        raise NotImplementedError

    def kernel_available(self) -> bool:
        """Whether this process has the native kernel."""
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The decoder's 2-D float32 rows go straight to the kernel, with no op
        # around it: this runs for every projection of every layer each step.
        if x.dim() != 2:
            return self(x.reshape(-1, self.in_features)).view(*x.shape[:-1], -1)
        out = self.matmul(x)
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
            and self.kernel_available()
        )

    def silu_product(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(y[:, :N / 2]) * y[:, N / 2:]`` of ``y = self(x)`` (2-D ``x``), a
        SwiGLU MLP's activation, computed as the native kernel's output: ``y`` is
        never stored. The same bits as the projection, then layer_ops'
        ``silu_and_mul``. Only where ``has_silu_product``."""
        raise NotImplementedError

    def native_projection(self) -> object:
        """This projection as the native decoder stack takes it."""
        raise NotImplementedError

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weight as the kernel reads it."""
        raise NotImplementedError


@dataclass
class DensePanels:
    """A float matrix in panel order: what ``PanelLinear`` and ``PanelEmbedding`` hold."""

    panels: torch.Tensor
    in_features: int
    out_features: int

    @classmethod
    def from_weight(cls, weight: torch.Tensor, arena: WeightArena | None = None) -> DensePanels:
        """``weight`` [out, in] packed, on ``arena``'s huge pages where given."""
        panels = pack_panels(weight.detach())
        if arena is not None:
            panels = arena.place(panels)
        return cls(panels, weight.shape[1], weight.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def rows(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight's rows ``rows`` (all if None) in their own dtype."""
        if rows is None:  # without the padding rows of the last panel
            return unpack_rows(self.panels, self.in_features)[: self.out_features]
        return unpack_rows(self.panels, self.in_features, rows)

    def kernel_args(self) -> tuple[torch.Tensor, int, int]:
        """The native kernel's arguments after ``x``."""
        return self.panels, self.in_features, self.out_features


class PanelLinear(PanelProjection):
    """A float weight in panels: the native dense kernel, or the weight unpacked
    per call for ``F.linear`` in its dtype."""

    def __init__(self, weight: DensePanels, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.in_features, weight.out_features, bias)
        self.weight_panels = weight

    @property
    def weight(self) -> torch.Tensor:
        """The matrix [out, in] in its dtype, as ``nn.Linear.weight`` holds it: unpacked
        from the panels on each read, a copy to look at (the panels are what runs)."""
        return self.weight_panels.rows()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            out: torch.Tensor = torch.ops.tokenloom_cpu.dense_linear(
                x, *self.weight_panels.kernel_args()
            )
            return out
        weight = self.weight_panels.rows()
        return F.linear(x.to(weight.dtype), weight).float()

    def silu_product(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.tokenloom_cpu.dense_linear_silu(
            x, *self.weight_panels.kernel_args()
        )
        return out

    def native_projection(self) -> object:
        return torch.classes.tokenloom_cpu.DenseProjection(*self.weight_panels.kernel_args())

    @property
    def weight_bytes(self) -> int:
        return self.weight_panels.nbytes


class PanelGather(nn.Module):
    """An embedding over a matrix kept in a kernel's panels (a tied LM head's,
    float or quantized): gathers rows as float32, natively where the forward
    plan's matmul is (``native``, as ``PanelProjection.native``) and the process
    has the kernel, else by the subclass's torch path."""

    def __init__(self) -> None:
        super().__init__()
        self.native = True

    def kernel_available(self) -> bool:
        """Whether this process has the native gather."""
        return True

    def native_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (integers, any shape) as float32 [ids.numel(), hidden]."""
        raise NotImplementedError

    def torch_rows(self, flat_ids: torch.Tensor) -> torch.Tensor:
        """The same rows without the native library (``flat_ids`` 1-D)."""
        raise NotImplementedError

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.native and self.kernel_available():
            rows = self.native_rows(ids)
        else:
            rows = self.torch_rows(ids.reshape(-1))
        return rows.view(*ids.shape, -1)


class PanelEmbedding(PanelGather):
    """Gathers rows of a [vocab, hidden] float matrix in panels."""

    def __init__(self, weight: DensePanels) -> None:
        super().__init__()
        self.weight_panels = weight

    @property
    def weight(self) -> torch.Tensor:
        """The table [vocab, hidden] in its dtype, unpacked: as ``PanelLinear.weight``."""
        return self.weight_panels.rows()

    def native_rows(self, ids: torch.Tensor) -> torch.Tensor:
        rows: torch.Tensor = torch.ops.tokenloom_cpu.panel_rows(
            ids, *self.weight_panels.kernel_args()
        )
        return rows

    def torch_rows(self, flat_ids: torch.Tensor) -> torch.Tensor:
        return self.weight_panels.rows(flat_ids).float()


def panel_weight_bytes(module: nn.Module) -> int:
    """Bytes of every float matrix in panels under ``module`` (shared ones once)."""
    seen = {
        id(m.weight_panels): m.weight_panels.nbytes
        for m in module.modules()
        if isinstance(m, (PanelLinear, PanelEmbedding))
    }
    return sum(seen.values())


def pack_linears(module: nn.Module, arena: WeightArena | None = None) -> int:
    """Replace every ``nn.Linear`` under ``module`` by a ``PanelLinear`` of its
    weight (on ``arena`` where given) and bias (as float32), freeing the original;
    returns how many."""
    replaced = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            bias = None if child.bias is None else child.bias.detach().float()
            weight = DensePanels.from_weight(child.weight, arena)
            setattr(module, name, PanelLinear(weight, bias))
            replaced += 1
        else:
            replaced += pack_linears(child, arena)
    return replaced


def use_native_matmul(module: nn.Module, native: bool) -> None:
    """Whether every ``PanelProjection`` and ``PanelGather`` under ``module`` runs
    its native kernel or its torch path (the forward plan's matmul=torch)."""
    for child in module.modules():
        if isinstance(child, (PanelProjection, PanelGather)):
            child.native = native
