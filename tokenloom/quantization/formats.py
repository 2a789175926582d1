"""Quantized weight layouts the kernels read, and conversion into them.

Every supported GGUF type is repacked at load time into one of two layouts that
reproduce its dequantized weights (``w = scale * q + min`` per group of
columns, up to float rounding):

- 4-bit: q in 0..15, two per byte (byte j of a 32-column block holds column j
  in its low nibble and column j + 16 in its high one), fp32 scale and min per
  32 columns. Q4_0 (min = -8 scale), Q4_1 and Q4_K (scale = d * sc, min =
  -dmin * m) land here: 6 bits per weight.
- 8-bit: one int8 per column, fp32 scale per ``group`` (16 or 32) columns and
  optionally a min. Q8_0 (group 32, no min), Q5_K (q in 0..31, group 32 with
  min) and Q6_K (q - 32, group 16, no min) land here.

``quantize_float`` makes the same layouts from float weights (``int4``:
asymmetric 4-bit per 32 columns; ``int8``: symmetric 8-bit per 32 columns) for
Hugging Face checkpoints. Columns are padded with zeros to a multiple of 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T

GROUP = 32  # columns per block of the 4-bit layout, and the padding unit
GGUF_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K)
FLOAT_METHODS = ("int8", "int4")


@dataclass
class QuantizedWeight:
    """A [out_features, in_features] matrix in one of the layouts above."""

    bits: int  # 4 or 8
    group: int  # columns per scale: 32, or 16 (8-bit only)
    in_features: int
    qweight: torch.Tensor  # uint8 [N, K_pad / 2] (4-bit) or int8 [N, K_pad]
    scales: torch.Tensor  # float32 [N, K_pad / group]
    mins: torch.Tensor | None  # float32 like scales, or None (zero)

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def nbytes(self) -> int:
        tensors = (self.qweight, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Integer codes as float32 [N (or len(rows)), K_pad]."""
        q = self.qweight if rows is None else self.qweight[rows]
        if self.bits == 8:
            return q.float()
        blocks = q.view(q.shape[0], -1, 1, 16)
        nibbles = torch.cat((blocks & 15, blocks >> 4), dim=2)
        return nibbles.reshape(q.shape[0], -1).float()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weights [N (or len(rows)), in_features]: the reference the
        kernel must match, and the embedding's gather."""
        codes = self.codes(rows)
        scales = self.scales if rows is None else self.scales[rows]
        w = codes.view(codes.shape[0], -1, self.group) * scales.unsqueeze(-1)
        if self.mins is not None:
            w = w + (self.mins if rows is None else self.mins[rows]).unsqueeze(-1)
        return w.reshape(codes.shape[0], -1)[:, : self.in_features]


def _pack(
    q: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, group: int, bits: int, k: int
) -> QuantizedWeight:
    """Codes [N, K_pad] (0..15 for 4 bits, int8 range for 8) and per-group
    scales/mins [N, K_pad / group] into a QuantizedWeight."""
    n = q.shape[0]
    if bits == 4:
        blocks = q.astype(np.uint8).reshape(n, -1, 2, 16)
        packed = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 0] | (blocks[:, :, 1] << 4)))
        qweight = packed.reshape(n, -1)
    else:
        qweight = torch.from_numpy(np.ascontiguousarray(q.astype(np.int8)))
    return QuantizedWeight(
        bits=bits,
        group=group,
        in_features=k,
        qweight=qweight,
        scales=torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)),
        mins=None if mins is None else torch.from_numpy(np.ascontiguousarray(mins, np.float32)),
    )


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[..., start : start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit sub-block scales and mins of Q4_K/Q5_K (12 bytes -> 8 + 8)."""
    d, m, m_d = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def from_gguf(raw: np.ndarray, ggml_type: T, shape: tuple[int, ...]) -> QuantizedWeight:
    """Repack a GGUF matrix (``raw``: uint8 [N, bytes per row]) of ``shape`` [N, K]."""
    n, k = shape
    shift = np.array([0, 4], dtype=np.uint8)
    if ggml_type in (T.Q4_0, T.Q4_1, T.Q8_0):
        blocks = raw.reshape(n, k // 32, -1)
        d = _f16(blocks, 0)
        if ggml_type == T.Q8_0:
            return _pack(blocks[..., 2:].view(np.int8).reshape(n, k), d, None, 32, 8, k)
        qs = blocks[..., 4:] if ggml_type == T.Q4_1 else blocks[..., 2:]
        nibbles = (qs[..., None, :] >> shift[:, None]) & 15  # [n, blocks, 2, 16]
        mins = _f16(blocks, 2) if ggml_type == T.Q4_1 else -8 * d
        return _pack(nibbles.reshape(n, k), d, mins, 32, 4, k)
    blocks = raw.reshape(n, k // 256, -1)
    if ggml_type in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
        sc, mn = _k_scales(blocks[..., 4:16])
        qs = blocks[..., -128:].reshape(n, -1, 4, 1, 32)
        q = ((qs >> shift[:, None]) & 15).reshape(n, -1, 8, 32)
        bits = 4
        if ggml_type == T.Q5_K:
            qh = blocks[..., 16:48].reshape(n, -1, 1, 32)
            high = (qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1
            q = q | (high << 4)
            bits = 8
        scales = (d * sc).reshape(n, -1)
        mins = -(dmin * mn).reshape(n, -1)
        return _pack(q.reshape(n, k), scales, mins, 32, bits, k)
    if ggml_type == T.Q6_K:
        ql = blocks[..., :128].reshape(n, -1, 2, 1, 64)
        qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
        low = ((ql >> shift[:, None]) & 15).reshape(n, -1, 2, 4, 32)
        high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
        codes = (low | (high << 4)).astype(np.int16) - 32
        sub = blocks[..., 192:208].view(np.int8).astype(np.float32)
        scales = (_f16(blocks, 208)[..., None] * sub).reshape(n, -1)
        return _pack(codes.reshape(n, k), scales, None, 16, 8, k)
    raise ValueError(f"GGUF type {ggml_type.name} has no quantized layout")


def quantize_float(weight: torch.Tensor, method: str) -> QuantizedWeight:
    """Quantize float weights [N, K] per 32 columns (``method``: int8 or int4)."""
    if method not in FLOAT_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(FLOAT_METHODS)}; got {method!r}")
    n, k = weight.shape
    k_pad = -(-k // GROUP) * GROUP
    w = torch.zeros(n, k_pad, dtype=torch.float32)
    w[:, :k] = weight.float()
    groups = w.view(n, -1, GROUP)
    if method == "int8":
        scales = groups.abs().amax(-1) / 127
        q = torch.round(groups / scales.clamp_min(1e-30).unsqueeze(-1)).clamp(-127, 127)
        return _pack(q.reshape(n, k_pad).numpy(), scales.numpy(), None, GROUP, 8, k)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = (high - low) / 15
    q = torch.round((groups - low.unsqueeze(-1)) / scales.clamp_min(1e-30).unsqueeze(-1))
    return _pack(q.clamp(0, 15).reshape(n, k_pad).numpy(), scales.numpy(), low.numpy(), GROUP, 4, k)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack matrices with the same columns (fused q/k/v or gate/up) into one,
    widening mixed layouts to the one that holds them all exactly (4 -> 8 bits,
    group 32 -> 16, no min -> zero min)."""
    if len(parts) == 1:
        return parts[0]
    bits = max(p.bits for p in parts)
    group = min(p.group for p in parts)
    with_min = any(p.mins is not None for p in parts)
    qs, scales, mins = [], [], []
    for p in parts:
        repeat = p.group // group
        q = p.qweight if p.bits == bits else p.codes().to(torch.int8)
        qs.append(q)
        scales.append(p.scales.repeat_interleave(repeat, dim=1))
        if with_min:
            m = p.mins if p.mins is not None else torch.zeros_like(p.scales)
            mins.append(m.repeat_interleave(repeat, dim=1))
    return QuantizedWeight(
        bits=bits,
        group=group,
        in_features=parts[0].in_features,
        qweight=torch.cat(qs),
        scales=torch.cat(scales),
        mins=torch.cat(mins) if with_min else None,
    )
