"""The native kernel's weight layout: a ``QuantizedWeight``'s output rows in panels
of ``PANEL``, and within a panel the rows' 4-byte words side by side.

The kernel then reads one word of 16 rows with one 64-byte load and computes
outer products (each int32 lane an output row), the same loop for every batch
size, so a row's result does not depend on the rows beside it (see
``csrc/quantization/quant_linear.cpp``). Converting is a transpose of the row-major layout
(``formats.py``), done once at load: a [N, bytes] matrix becomes [N_pad / 16,
bytes / 4, 16, 4] (the 6-bit layout's high plane likewise), and each [N, G]
factor [N_pad / 16, G, 16], rows past N zero.

A matrix also says how its activations are rounded: ``act_group`` columns per
int8 scale, 8 or 16. Per 16 the kernel does a sixth less work on the pipes it is
bound by (``csrc/quantization/quant_linear.cpp``) and rounds coarser: ``act_group_for`` picks
it for the MLP's two projections.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.model.huge_pages import WeightArena
from tokenloom.quantization.formats import GroupFactors, QuantizedWeight, held_tensors

PANEL = 16  # output rows per panel
_WORD = 4  # bytes of a row per word

# A scale per 16 activation columns is the faster kernel, per 8 the closer one
# to float32. The MLP's input projection reads an RMSNorm's output: every
# token's row is scaled to one RMS, so its columns differ only by the norm's
# weights, and 16 columns per scale cost it little; the down projection's input
# tolerates it as well. q and k read a norm's output too, but their errors pass
# through the attention's softmax, and o reads the attention's output: those
# keep 8, where 16 moved the model's argmax measurably further from float32's.
_MATRICES_PER_16 = ("gate_up_proj", "down_proj")


def act_group_for(weight_name: str) -> int:
    """Activation columns per int8 scale for the matrix ``weight_name``
    (``layers.3.mlp.gate_up_proj.weight``)."""
    module = weight_name.removesuffix(".weight").rsplit(".", 1)[-1]
    return 16 if module in _MATRICES_PER_16 else 8


def _to_panels(t: torch.Tensor) -> torch.Tensor:
    """[N, C, *rest] -> [N_pad / PANEL, C, PANEL, *rest], padded with zero rows."""
    pad = -t.shape[0] % PANEL
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.view(-1, PANEL, *t.shape[1:]).transpose(1, 2).contiguous()


def _from_panels(t: torch.Tensor, n: int, rows: torch.Tensor | None) -> torch.Tensor:
    """``_to_panels``'s inverse: rows ``rows`` (all ``n`` if None) as [len, C, *rest]."""
    if rows is None:
        return t.transpose(1, 2).reshape(-1, *t.shape[1:2], *t.shape[3:])[:n]
    return t[rows // PANEL, :, rows % PANEL]


@dataclass
class PanelWeight:
    """A ``QuantizedWeight`` in panel order: what ``QuantLinear`` and
    ``QuantEmbedding`` hold and the kernel reads."""

    bits: int
    group: int
    in_features: int
    out_features: int
    qweight: torch.Tensor  # [panels, words, PANEL, 4], uint8 (4-, 6-bit) or int8
    scales: GroupFactors  # base [panels, G / per, PANEL], codes [panels, G, PANEL]
    mins: GroupFactors | None
    qhigh: torch.Tensor | None = None  # 6-bit: [panels, words / 2, PANEL, 4] uint8
    act_group: int = 8  # activation columns per int8 scale: 8 or 16

    @classmethod
    def from_rows(
        cls, weight: QuantizedWeight, act_group: int = 8, arena: WeightArena | None = None
    ) -> PanelWeight:
        """The panel layout of ``weight`` (shared factors stay shared), on
        ``arena``'s huge pages where given."""
        n = weight.out_features

        def convert(t: torch.Tensor) -> torch.Tensor:
            packed = t is weight.qweight or t is weight.qhigh
            panels = _to_panels(t.view(n, -1, _WORD) if packed else t)
            return panels if arena is None else arena.place(panels)

        panels = weight.map_tensors(convert)
        return cls(
            weight.bits,
            weight.group,
            weight.in_features,
            n,
            panels.qweight,
            panels.scales,
            panels.mins,
            panels.qhigh,
            act_group,
        )

    def rows(self, rows: torch.Tensor | None = None) -> QuantizedWeight:
        """Rows ``rows`` (all if None) back in the row-major layout."""
        n = self.out_features

        def factors(f: GroupFactors) -> GroupFactors:
            codes = None if f.codes is None else _from_panels(f.codes, n, rows)
            return GroupFactors(_from_panels(f.base, n, rows), codes, f.multiplier)

        def packed(t: torch.Tensor) -> torch.Tensor:
            rows_of_t = _from_panels(t, n, rows)
            return rows_of_t.reshape(rows_of_t.shape[0], -1)

        return QuantizedWeight(
            self.bits,
            self.group,
            self.in_features,
            packed(self.qweight),
            factors(self.scales),
            None if self.mins is None else factors(self.mins),
            None if self.qhigh is None else packed(self.qhigh),
        )

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weights [N (or len(rows)), in_features]."""
        return self.rows(rows).dequantize()

    def tensors(self) -> list[torch.Tensor]:
        return held_tensors(self.qweight, self.qhigh, self.scales, self.mins)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def kernel_args(self) -> tuple[object, ...]:
        """The native kernel's arguments after ``x``."""
        mins = self.mins
        return (
            self.qweight,
            self.qhigh,
            self.scales.base,
            self.scales.codes,
            None if mins is None else mins.base,
            None if mins is None else mins.codes,
            1.0 if mins is None else mins.multiplier,
            self.bits,
            self.group,
            self.out_features,
            self.act_group,
        )
