"""Quantized weight layouts (row-major; ``panels.py`` transposes them for the kernel),
and conversion into them.

Every supported GGUF type is repacked at load time into one of three layouts
that reproduce its dequantized weights exactly (``w = scale * q + min`` per
group of columns):

- 4-bit: q in 0..15, two per byte (byte j of a 32-column block holds column j
  in its low nibble and column j + 16 in its high one), a scale and a min per
  32 columns. Q4_0 (min = -8 scale), Q4_1 and Q4_K land here.
- 6-bit: q in 0..63; its low four bits two per byte (byte j of each 8 columns
  holds column j low and j + 4 high), its top two in a plane of their own
  (``qhigh``, 2 bits a column, see ``pack_codes``), a scale and a min per
  ``group`` (16 or 32) columns. Q5_K (q in 0..31, group 32) and Q6_K (min =
  -32 scale, group 16) land here.
- 8-bit: one int8 per column, a scale per ``group`` (16 or 32) columns and
  optionally a min. Q8_0 (group 32, no min) lands here, and fused matrices that
  mix it with other types.

Scales and mins (``GroupFactors``) are kept as the file stores them: fp16 per
group (Q4_0, Q4_1, Q8_0), or an fp16 base per 256-column super-block times an
int8 code per group (K-quants: ``d * sc`` and ``-dmin * m``), so the layouts
cost what the file does plus the codes' unpacking (Q4_K: 4.6 bits per weight
against the file's 4.5; Q6_K: 6.6, as in the file; Q5_K, in 6 bits: 6.6 against
5.5).

``quantize_float`` makes the same layouts from float weights (``int4``:
asymmetric 4-bit per 32 columns; ``int8``: symmetric 8-bit per 32 columns) for
Hugging Face checkpoints. Columns are padded with zeros to a multiple of 32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T

GROUP = 32  # columns per block of the 4-bit layout, and the padding unit
SUPER_BLOCK = 256  # columns per K-quant super-block
GGUF_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K)
FLOAT_METHODS = ("int8", "int4")
_FP16_MAX = 65504.0


@dataclass
class GroupFactors:
    """Per-group scales (or mins) of an [N, K_pad] matrix with G groups per row:
    ``value[n, g] = multiplier * base[n, g // per] * codes[n, g]``, or
    ``multiplier * base[n, g]`` without codes (then ``per`` is 1). The multiplier
    is a constant code: Q4_0's min is -8 times its scale, sharing its base."""

    base: torch.Tensor  # float16 (or float32, where fp16 would round) [N, G / per]
    codes: torch.Tensor | None = None  # int8 [N, G]
    multiplier: float = 1.0

    @property
    def groups(self) -> int:
        return int((self.codes if self.codes is not None else self.base).shape[1])

    @property
    def per(self) -> int:
        return self.groups // int(self.base.shape[1])

    def values(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [N (or len(rows)), G]."""
        base = (self.base if rows is None else self.base[rows]).float() * self.multiplier
        if self.codes is None:
            return base
        codes = self.codes if rows is None else self.codes[rows]
        return base.repeat_interleave(self.per, dim=1) * codes.float()

    def widened(self, repeat: int) -> GroupFactors:
        """The same factors for groups ``repeat`` times narrower."""
        if repeat == 1:
            return self
        if self.codes is None:
            return GroupFactors(self.base.repeat_interleave(repeat, dim=1), None, self.multiplier)
        return GroupFactors(self.base, self.codes.repeat_interleave(repeat, dim=1), self.multiplier)

    def form(self) -> tuple[torch.dtype, int, bool, float]:
        return self.base.dtype, self.per, self.codes is not None, self.multiplier

    def zeros_like(self) -> GroupFactors:
        codes = None if self.codes is None else torch.zeros_like(self.codes)
        return GroupFactors(torch.zeros_like(self.base), codes, self.multiplier)


def _factors(values: np.ndarray | torch.Tensor) -> GroupFactors:
    """``quantize_float``'s per-group values as fp16 where that is exact and in
    range, else float32; computed scales are rarely exact in fp16, so in
    practice they stay float32."""
    t = torch.as_tensor(values, dtype=torch.float32).contiguous()
    half = t.half()
    exact = bool(t.abs().max() <= _FP16_MAX) and torch.equal(half.float(), t)
    return GroupFactors(half if exact else t)


def held_tensors(
    qweight: torch.Tensor,
    qhigh: torch.Tensor | None,
    scales: GroupFactors,
    mins: GroupFactors | None,
) -> list[torch.Tensor]:
    """Every tensor of a weight, each once (Q4_0's and Q6_K's mins share the
    scales' base, Q6_K's its codes too)."""
    found = [qweight, qhigh, scales.base, scales.codes]
    if mins is not None:
        found += [mins.base, mins.codes]
    return list({id(t): t for t in found if t is not None}.values())


@dataclass
class QuantizedWeight:
    """A [out_features, in_features] matrix in one of the layouts above."""

    bits: int  # 4, 6 or 8
    group: int  # columns per scale: 32, or 16 (6- and 8-bit)
    in_features: int
    qweight: torch.Tensor  # uint8 [N, K_pad / 2] (4- and 6-bit) or int8 [N, K_pad]
    scales: GroupFactors
    mins: GroupFactors | None  # None: zero
    qhigh: torch.Tensor | None = None  # 6-bit: uint8 [N, K_pad / 4], the top 2 bits

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    def tensors(self) -> list[torch.Tensor]:
        return held_tensors(self.qweight, self.qhigh, self.scales, self.mins)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The same weight with ``fn`` applied to each tensor, sharing kept."""
        done: dict[int, torch.Tensor] = {}

        def apply(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if id(t) not in done:
                done[id(t)] = fn(t)
            return done[id(t)]

        def factors(f: GroupFactors) -> GroupFactors:
            base = apply(f.base)
            assert base is not None
            return GroupFactors(base, apply(f.codes), f.multiplier)

        qweight = apply(self.qweight)
        assert qweight is not None
        mins = None if self.mins is None else factors(self.mins)
        return QuantizedWeight(
            self.bits,
            self.group,
            self.in_features,
            qweight,
            factors(self.scales),
            mins,
            apply(self.qhigh),
        )

    def codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Integer codes as float32 [N (or len(rows)), K_pad]."""
        q = self.qweight if rows is None else self.qweight[rows]
        if self.bits == 8:
            return q.float()
        n = q.shape[0]
        if self.bits == 4:  # byte j of a 32-column block: columns j and j + 16
            blocks = q.view(n, -1, 1, 16)
            return torch.cat((blocks & 15, blocks >> 4), dim=2).reshape(n, -1).float()
        words = q.view(n, -1, 1, 4)  # byte j of a word: columns j and j + 4 of its 8
        nibbles = torch.cat((words & 15, words >> 4), dim=2)
        assert self.qhigh is not None
        high = (self.qhigh if rows is None else self.qhigh[rows]).view(n, -1, 1, 4)
        top = (high >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3
        return (nibbles | (top.view(nibbles.shape) << 4)).reshape(n, -1).float()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weights [N (or len(rows)), in_features]: the reference the
        kernel must match, and the embedding's gather."""
        codes = self.codes(rows)
        w = codes.view(codes.shape[0], -1, self.group) * self.scales.values(rows).unsqueeze(-1)
        if self.mins is not None:
            w = w + self.mins.values(rows).unsqueeze(-1)
        return w.reshape(codes.shape[0], -1)[:, : self.in_features]


def pack_codes(q: np.ndarray, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes [N, K_pad] (0..15 for 4 bits, 0..63 for 6, int8 range for 8) as the
    layout's qweight and, 6 bits, qhigh."""
    n = q.shape[0]
    if bits == 8:
        return torch.from_numpy(np.ascontiguousarray(q.astype(np.int8))), None
    codes = q.astype(np.uint8)
    if bits == 4:
        halves = codes.reshape(n, -1, 2, 16)  # byte j: columns j and j + 16 of a block
        return torch.from_numpy(_nibbles(halves).reshape(n, -1)), None
    halves = codes.reshape(n, -1, 2, 4)  # byte j of a word: columns j and j + 4 of its 8
    top = (codes >> 4).reshape(n, -1, 4, 4)  # [n, word pairs, word * 2 + half, byte]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    qhigh = np.bitwise_or.reduce(top << shifts, axis=2)
    return (
        torch.from_numpy(_nibbles(halves).reshape(n, -1)),
        torch.from_numpy(np.ascontiguousarray(qhigh.reshape(n, -1))),
    )


def _nibbles(halves: np.ndarray) -> np.ndarray:
    """[..., 2, B] codes -> [..., B] bytes: the first half low, the second high."""
    low = halves[..., 0, :] & 15
    return np.ascontiguousarray(low | ((halves[..., 1, :] & 15) << 4))


def _pack(
    q: np.ndarray, scales: GroupFactors, mins: GroupFactors | None, group: int, bits: int, k: int
) -> QuantizedWeight:
    """Codes [N, K_pad] and their factors into a QuantizedWeight."""
    qweight, qhigh = pack_codes(q, bits)
    return QuantizedWeight(bits, group, k, qweight, scales, mins, qhigh)


def _f16(blocks: np.ndarray, start: int) -> torch.Tensor:
    """The fp16 field at byte ``start`` of every block, as a float16 tensor."""
    return torch.from_numpy(blocks[..., start : start + 2].copy().view(np.float16)[..., 0])


def _int8(values: np.ndarray, n: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values.astype(np.int8).reshape(n, -1)))


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit sub-block scales and mins of Q4_K/Q5_K (12 bytes -> 8 + 8)."""
    d, m, m_d = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def from_gguf(raw: np.ndarray, ggml_type: T, shape: tuple[int, ...]) -> QuantizedWeight:
    """Repack a GGUF matrix (``raw``: uint8 [N, bytes per row]) of ``shape`` [N, K]."""
    n, k = shape
    shift = np.array([0, 4], dtype=np.uint8)
    if ggml_type in (T.Q4_0, T.Q4_1, T.Q8_0):
        blocks = raw.reshape(n, k // 32, -1)
        d = GroupFactors(_f16(blocks, 0))
        if ggml_type == T.Q8_0:
            return _pack(blocks[..., 2:].view(np.int8).reshape(n, k), d, None, 32, 8, k)
        qs = blocks[..., 4:] if ggml_type == T.Q4_1 else blocks[..., 2:]
        nibbles = (qs[..., None, :] >> shift[:, None]) & 15  # [n, blocks, 2, 16]
        if ggml_type == T.Q4_1:
            mins = GroupFactors(_f16(blocks, 2))
        else:  # -8 d, exactly, sharing d
            mins = GroupFactors(d.base, multiplier=-8.0)
        return _pack(nibbles.reshape(n, k), d, mins, 32, 4, k)
    blocks = raw.reshape(n, k // SUPER_BLOCK, -1)
    if ggml_type in (T.Q4_K, T.Q5_K):
        sc, mn = _k_scales(blocks[..., 4:16])
        qs = blocks[..., -128:].reshape(n, -1, 4, 1, 32)
        q = ((qs >> shift[:, None]) & 15).reshape(n, -1, 8, 32)
        bits = 4
        if ggml_type == T.Q5_K:
            qh = blocks[..., 16:48].reshape(n, -1, 1, 32)
            high = (qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1
            q = q | (high << 4)
            bits = 6
        scales = GroupFactors(_f16(blocks, 0), _int8(sc, n))
        mins = GroupFactors(-_f16(blocks, 2), _int8(mn, n))
        return _pack(q.reshape(n, k), scales, mins, 32, bits, k)
    if ggml_type == T.Q6_K:
        ql = blocks[..., :128].reshape(n, -1, 2, 1, 64)
        qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
        low = ((ql >> shift[:, None]) & 15).reshape(n, -1, 2, 4, 32)
        high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
        scales = GroupFactors(_f16(blocks, 208), _int8(blocks[..., 192:208].view(np.int8), n))
        mins = GroupFactors(scales.base, scales.codes, multiplier=-32.0)  # q - 32, exactly
        return _pack((low | (high << 4)).reshape(n, k), scales, mins, 16, 6, k)
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
        scales = _factors(groups.abs().amax(-1) / 127)
        step = scales.values().clamp_min(1e-30).unsqueeze(-1)
        q = torch.round(groups / step).clamp(-127, 127)
        return _pack(q.reshape(n, k_pad).numpy(), scales, None, GROUP, 8, k)
    mins = _factors(groups.amin(-1))
    low = mins.values().unsqueeze(-1)
    # The step covers the group's range above its fp16-rounded min.
    scales = _factors(((groups.amax(-1, keepdim=True) - low) / 15).squeeze(-1))
    step = scales.values().clamp_min(1e-30).unsqueeze(-1)
    q = torch.round((groups - low) / step).clamp(0, 15)
    return _pack(q.reshape(n, k_pad).numpy(), scales, mins, GROUP, 4, k)


def _join(factors: list[GroupFactors]) -> GroupFactors:
    """Row-stacked factors: kept in their form if all parts share it, else as
    float32 values per group (exact either way)."""
    if len({f.form() for f in factors}) == 1:
        codes = [f.codes for f in factors]
        joined = None if codes[0] is None else torch.cat([c for c in codes if c is not None])
        return GroupFactors(torch.cat([f.base for f in factors]), joined, factors[0].multiplier)
    return GroupFactors(torch.cat([f.values() for f in factors]))


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack matrices with the same columns (fused q/k/v or gate/up) into one,
    widening mixed layouts to the one that holds them all exactly (4 -> 6 -> 8 bits,
    group 32 -> 16, no min -> zero min)."""
    if len(parts) == 1:
        return parts[0]
    bits = max(p.bits for p in parts)
    group = min(p.group for p in parts)
    scales = [p.scales.widened(p.group // group) for p in parts]
    joined_scales = _join(scales)
    joined_mins = None
    if any(p.mins is not None for p in parts):
        mins = [
            p.mins.widened(p.group // group) if p.mins is not None else s.zeros_like()
            for p, s in zip(parts, scales, strict=True)
        ]
        joined_mins = _join(mins)
        # Q4_0's -8 d keeps sharing d; Q6_K's -32 d sc keeps sharing d and sc.
        if all(m.base is s.base for m, s in zip(mins, scales, strict=True)):
            joined_mins.base = joined_scales.base
        if all(m.codes is s.codes is not None for m, s in zip(mins, scales, strict=True)):
            joined_mins.codes = joined_scales.codes
    layouts = [
        (p.qweight, p.qhigh) if p.bits == bits else pack_codes(p.codes().numpy(), bits)
        for p in parts
    ]
    return QuantizedWeight(
        bits=bits,
        group=group,
        in_features=parts[0].in_features,
        qweight=torch.cat([qweight for qweight, _ in layouts]),
        scales=joined_scales,
        mins=joined_mins,
        qhigh=None if bits != 6 else torch.cat([h for _, h in layouts if h is not None]),
    )
