"""Building blocks of the decoders: RMSNorm, rotary embeddings (with their scaling
variants), gated MLPs.

Rotary embeddings use the Hugging Face (rotate-half) layout. GGUF files from
llama.cpp store Q/K rows interleaved instead; the GGUF loader undoes that so one
layout serves both sources. The cos/sin table is computed once for every
position up to ``max_position_embeddings`` and indexed once per forward.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 like the reference models.

    ``kernels`` (set by ``CausalLM.use_layer_ops`` from the forward plan's
    layer_ops) is the namespace of fused kernels that replace the torch ops:
    ``torch.ops.tokenloom_cpu`` (native, ``csrc/layer_ops.cpp``) or
    ``ops.cuda.layer_ops`` (Triton); both take the same arguments.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.kernels: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            rows = x.reshape(-1, x.shape[-1])  # the kernels take [T, n] (q/k norms: [T*H, D])
            out = torch.empty_like(rows)
            self.kernels.rms_norm(out, rows, self.weight, self.eps)
            return out.view(x.shape)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a sublayer's output joins the residual
        stream, which is normalized for the next one. The fused kernels reuse the
        storage of both inputs, which the caller must own."""
        if self.kernels is not None:
            self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self(residual), residual


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, with position-independent RoPE
    scaling applied (dynamic and longrope, which depend on the position, are
    handled by ``rope_table``)."""
    # float32 throughout, as transformers and llama.cpp compute it.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "freq_factors":
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band
        # between blended smoothly.
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(medium, blended, inv_freq)
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(head_dim, theta, scaling)
    elif kind not in ("dynamic", "longrope"):
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    return inv_freq


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolate (divide by ``factor``) the low frequencies, keep the high
    ones, ramp linearly between the dimensions that turn ``beta_slow`` and
    ``beta_fast`` times over the original context."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    keep = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor YaRN and longrope apply to cos and sin (1.0 for the others)."""
    if scaling is None:
        return 1.0
    kind = scaling["rope_type"]
    if scaling.get("attention_factor") is not None and kind in ("yarn", "longrope"):
        return float(scaling["attention_factor"])
    if kind == "yarn":
        factor = float(scaling["factor"])
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if mscale and mscale_all_dim:
            return get_mscale(factor, float(mscale)) / get_mscale(factor, float(mscale_all_dim))
        return get_mscale(factor)
    if kind == "longrope":
        original = float(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def rope_angles(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Rotation angles [max_positions, head_dim / 2] (float32).

    Dynamic NTK and longrope depend on the sequence length; transformers
    recomputes their frequencies per forward from the longest position in it,
    which during cached generation is the new token's. A paged cache keeps
    earlier keys as they were rotated, so each position here gets the frequencies
    of a sequence ending at it: identical to transformers within the original
    context and to its token-by-token decoding beyond it."""
    pos = torch.arange(max_positions, dtype=torch.float32)
    kind = scaling["rope_type"] if scaling is not None else None
    if kind == "dynamic":
        assert scaling is not None
        original = int(scaling["original_max_position_embeddings"])
        factor = float(scaling["factor"])
        seq_len = torch.clamp(pos + 1, min=original)
        bases = theta * ((factor * seq_len / original) - (factor - 1)) ** (
            head_dim / (head_dim - 2)
        )
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        inv_freq = 1.0 / (bases[:, None] ** exponents[None, :])
        return pos[:, None] * inv_freq
    if kind == "longrope":
        assert scaling is not None
        original = int(scaling["original_max_position_embeddings"])
        plain = rope_inv_freq(head_dim, theta, None)
        short = plain / torch.tensor(scaling["short_factor"], dtype=torch.float32)
        long = plain / torch.tensor(scaling["long_factor"], dtype=torch.float32)
        use_long = (pos + 1 > original)[:, None]
        return torch.where(use_long, torch.outer(pos, long), torch.outer(pos, short))
    return torch.outer(pos, rope_inv_freq(head_dim, theta, scaling))


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table; ``cos_sin(positions)`` -> ([T, 1, R/2], [T, 1, R/2])
    where R = ``rotary_dim`` (the whole head, or its first part with partial RoPE)."""

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
    ) -> None:
        super().__init__()
        self.head_dim = rotary_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)

    def build_cache(
        self, device: torch.device, dtype: torch.dtype, max_positions: int | None = None
    ) -> None:
        """Fill the table (its first ``max_positions`` rows, when given: a row does not
        depend on the table's length); called once the module is on its device."""
        positions = min(max_positions or self.max_positions, self.max_positions)
        freqs = rope_angles(self.head_dim, positions, self.theta, self.scaling)
        freqs = freqs.to(device)
        factor = rope_attention_factor(self.scaling)
        self.cos_cache = (freqs.cos() * factor).to(dtype)
        self.sin_cache = (freqs.sin() * factor).to(dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] (rotate-half layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class SiluProductLinear(Protocol):
    """A gate/up projection that can output ``silu(gate) * up`` itself, never storing
    its output (``quantization.linear.QuantLinear``, where ``has_silu_product``)."""

    has_silu_product: bool

    def silu_product(self, x: torch.Tensor) -> torch.Tensor: ...


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul: SwiGLU
    (``silu``; with ``kernels`` set, as ``RMSNorm``'s, the activation is one fused
    kernel) or GeGLU (``gelu_pytorch_tanh``, Gemma)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, act: str = "silu"
    ) -> None:
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported MLP activation {act!r}")
        self.intermediate_size = intermediate_size
        self.act = act
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)
        self.kernels: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(x))

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x), the down projection's input."""
        if self.act == "silu" and self.kernels is not None:
            gate_up_proj = self.gate_up_proj
            if getattr(gate_up_proj, "has_silu_product", False):
                return cast(SiluProductLinear, gate_up_proj).silu_product(x)
            gate_up = gate_up_proj(x)
            act = gate_up.new_empty(gate_up.shape[0], self.intermediate_size)
            self.kernels.silu_and_mul(act, gate_up)
            return act
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        if self.act == "silu":
            return F.silu(gate) * up
        return F.gelu(gate, approximate="tanh") * up


SiluMLP = GatedMLP  # the Llama family's MLP
