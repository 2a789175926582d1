"""Building blocks of Llama-family decoders: RMSNorm, rotary embeddings, SiLU MLP.

Rotary embeddings use the Hugging Face (rotate-half) layout. GGUF files from
llama.cpp store Q/K rows interleaved instead; the GGUF loader undoes that so one
layout serves both sources. The cos/sin table is computed once for every
position up to ``max_position_embeddings`` and indexed once per forward.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 like the reference models.

    With ``fused_ops`` set (float32 on CPU, see ``CausalLM.use_fused_layer_ops``)
    it runs the native kernels of ``csrc/layer_ops.cpp``.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.fused_ops = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_ops:
            out = torch.empty_like(x)
            torch.ops.tokenloom_cpu.rms_norm(out, x, self.weight, self.eps)
            return out
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a sublayer's output joins the residual
        stream, which is normalized for the next one. The fused kernel reuses the
        storage of both inputs, which the caller must own."""
        if self.fused_ops:
            torch.ops.tokenloom_cpu.add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self(residual), residual


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, with RoPE scaling applied."""
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
    else:
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table; ``cos_sin(positions)`` -> ([T, 1, D/2], [T, 1, D/2])."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)

    def build_cache(self, device: torch.device, dtype: torch.dtype) -> None:
        """Fill the table; called after the module is materialised on its device."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, inv_freq)
        self.cos_cache = freqs.cos().to(dtype)
        self.sin_cache = freqs.sin().to(dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] (rotate-half layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class SiluMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul (and the
    activation into one native kernel when ``fused_ops`` is set)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)
        self.fused_ops = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused_ops:
            act = gate_up.new_empty(gate_up.shape[0], self.intermediate_size)
            torch.ops.tokenloom_cpu.silu_and_mul(act, gate_up)
            return self.down_proj(act)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
