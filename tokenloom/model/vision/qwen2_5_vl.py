"""Qwen2.5-VL's vision tower: dynamic resolution, windowed attention, a patch merger.

An image of any size (resized by the processor to multiples of 28 pixels)
arrives as its flattened patches ``[t*h*w, C*T*P*P]`` with its grid ``(t, h,
w)``. Patches are embedded (a 3-D convolution, i.e. one matmul), given 2-D
rotary positions (row, column), and reordered so that each window of
``window_size`` pixels is contiguous: most blocks attend within windows, the
``fullatt_block_indexes`` ones over the whole image (each temporal frame).
The merger then turns each 2x2 group of patches into one token of the text
model's width, and the window order is undone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.model.layers import RMSNorm, apply_rope


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, temporal: int, channels: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.shape = (channels, temporal, patch, patch)
        self.proj = nn.Conv3d(
            channels,
            dim,
            kernel_size=self.shape[1:],
            stride=self.shape[1:],
            bias=False,
            dtype=dtype,
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # A convolution whose kernel is the whole patch: one matmul over flat patches.
        weight = self.proj.weight
        return pixels.to(weight.dtype) @ weight.view(weight.shape[0], -1).t()


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True, dtype=dtype)
        self.proj = nn.Linear(dim, dim, dtype=dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        """x [N, dim], attention within each segment ``bounds[i]:bounds[i+1]``."""
        n, dim = x.shape
        qkv = self.qkv(x).view(n, 3, self.heads, dim // self.heads)
        # q and k rotate together, in float32 like the reference.
        qk = apply_rope(qkv[:, :2].reshape(n, 2 * self.heads, -1).float(), cos, sin)
        q, k = qk.to(x.dtype).view(n, 2, self.heads, -1).unbind(1)
        v = qkv[:, 2]
        out = torch.empty(n, self.heads, dim // self.heads, dtype=x.dtype, device=x.device)
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            seg = slice(start, end)
            out[seg] = F.scaled_dot_product_attention(
                q[seg].transpose(0, 1), k[seg].transpose(0, 1), v[seg].transpose(0, 1)
            ).transpose(0, 1)
        return self.proj(out.view(n, dim))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, intermediate, dtype=dtype)
        self.up_proj = nn.Linear(dim, intermediate, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        dim = int(cfg["hidden_size"])
        self.norm1 = RMSNorm(dim, 1e-6, dtype)
        self.norm2 = RMSNorm(dim, 1e-6, dtype)
        self.attn = VisionAttention(dim, int(cfg["num_heads"]), dtype)
        self.mlp = VisionMLP(dim, int(cfg["intermediate_size"]), dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, dim: int, context: int, merge: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden = context * merge * merge
        self.ln_q = RMSNorm(context, 1e-6, dtype)
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden, self.hidden, dtype=dtype),
            nn.GELU(),
            nn.Linear(self.hidden, dim, dtype=dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2_5_VisionTransformer(nn.Module):
    """``forward(pixel_values [N, C*T*P*P], grid_thw [[t, h, w], ...])`` -> [N / merge^2,
    out_hidden_size], the images' tokens in order."""

    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        dim = int(cfg["hidden_size"])
        self.merge = int(cfg.get("spatial_merge_size", 2))
        self.patch = int(cfg.get("patch_size", 14))
        self.window = int(cfg.get("window_size", 112))
        self.full_attention = set(cfg.get("fullatt_block_indexes", ()))
        heads = int(cfg["num_heads"])
        self.theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.head_dim = dim // heads
        self.patch_embed = PatchEmbed(
            self.patch,
            int(cfg.get("temporal_patch_size", 2)),
            int(cfg.get("in_channels", 3)),
            dim,
            dtype,
        )
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype) for _ in range(int(cfg["depth"])))
        self.merger = PatchMerger(int(cfg["out_hidden_size"]), dim, self.merge, dtype)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        unit = self.merge * self.merge
        window_index, window_bounds, frame_bounds = self._windows(grid_thw)
        order = torch.from_numpy(window_index).to(pixel_values.device)
        x = self.patch_embed(pixel_values)
        n = x.shape[0]
        # Whole merge units move together, so windows never split one.
        x = x.view(n // unit, unit, -1)[order].view(n, -1)
        angles = self._angles(grid_thw).to(x.device)
        angles = angles.view(n // unit, unit, -1)[order].view(n, -1)
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_bounds if i in self.full_attention else window_bounds)
        return self.merger(x)[torch.argsort(order)]

    def _angles(self, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """Rotation angles [N, head_dim / 2] of each patch: its row's, then its column's,
        patches listed merge unit by merge unit."""
        rows, cols = [], []
        m = self.merge
        for t, h, w in grid_thw:
            r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
            blocks = (h // m, m, w // m, m)
            rows.append(np.tile(r.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1), t))
            cols.append(np.tile(c.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1), t))
        row = torch.from_numpy(np.concatenate(rows)).float()
        col = torch.from_numpy(np.concatenate(cols)).float()
        # Axial RoPE: half of each head's rotary frequencies per axis (row, column).
        spatial = self.head_dim // 2
        inv_freq = 1.0 / (
            self.theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial)
        )
        return torch.cat([torch.outer(row, inv_freq), torch.outer(col, inv_freq)], -1)

    def _windows(
        self, grid_thw: list[tuple[int, int, int]]
    ) -> tuple[np.ndarray, list[int], list[int]]:
        """(merge units in window order, window boundaries in patches, frame boundaries)."""
        units_per_window = self.window // self.merge // self.patch
        unit = self.merge * self.merge
        index: list[np.ndarray] = []
        window_bounds = [0]
        frame_bounds = [0]
        first = 0
        for t, h, w in grid_thw:
            gh, gw = h // self.merge, w // self.merge
            ids = np.arange(t * gh * gw).reshape(t, gh, gw)
            for frame in range(t):
                for r in range(0, gh, units_per_window):
                    for c in range(0, gw, units_per_window):
                        block = ids[frame, r : r + units_per_window, c : c + units_per_window]
                        index.append(block.reshape(-1) + first)
                        window_bounds.append(window_bounds[-1] + block.size * unit)
                frame_bounds.append(frame_bounds[-1] + h * w)
            first += t * gh * gw
        return np.concatenate(index), window_bounds, frame_bounds
