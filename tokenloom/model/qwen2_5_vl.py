"""Qwen2.5-VL: its vision tower and a Qwen2 text model with multimodal RoPE.

The text model is this package's ``CausalLM`` with one change: rotary
positions are 3-D. Each token has a (time, height, width) position; text
tokens have the same value in all three, image tokens their frame, row and
column (computed by the runner, ``multimodal.mrope``). The rotary frequencies
are split in ``mrope_section`` parts, the first rotated by the time
position, the second by the height, the third by the width.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.layers import RotaryEmbedding
from tokenloom.model.llama import CausalLM
from tokenloom.model.vision.qwen2_5_vl import Qwen2_5_VisionTransformer


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE over [3, T] positions (``cos_sin`` takes [T] too: the text-only case)."""

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        section: tuple[int, ...],
    ) -> None:
        super().__init__(rotary_dim, max_positions, theta, scaling)
        bounds = [0]
        for size in section:
            bounds.append(bounds[-1] + size)
        self.bounds = bounds

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions)
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]  # [3, T, R/2]
        parts = list(zip(self.bounds[:-1], self.bounds[1:], strict=True))
        cos = torch.cat([cos[i, :, a:b] for i, (a, b) in enumerate(parts)], dim=-1)
        sin = torch.cat([sin[i, :, a:b] for i, (a, b) in enumerate(parts)], dim=-1)
        return cos.unsqueeze(1), sin.unsqueeze(1)


class Qwen2_5_VLForConditionalGeneration(CausalLM):
    """``embed_images([{"pixel_values": [N, D], "image_grid_thw": [1, 3]}, ...])`` -> one
    [tokens, hidden] tensor per image; ``forward`` takes [3, T] positions."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__(arch, dtype)
        assert arch.vision is not None and arch.mrope_section is not None
        self.rotary = MRotaryEmbedding(
            int(arch.head_dim * arch.partial_rotary_factor),
            arch.max_position_embeddings,
            arch.rope_theta,
            arch.rope_scaling,
            arch.mrope_section,
        )
        self.visual = Qwen2_5_VisionTransformer(arch.vision.vision_config, dtype)

    def embed_images(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        grids = [
            tuple(int(n) for n in item["image_grid_thw"].reshape(-1).tolist()) for item in items
        ]
        pixels = torch.cat([item["pixel_values"] for item in items])
        out = self.visual(pixels, grids)  # type: ignore[arg-type]
        unit = self.visual.merge * self.visual.merge
        return list(out.split([t * h * w // unit for t, h, w in grids]))

    def _map_name(self, hf_name: str) -> tuple[str, int | None, int] | None:
        if hf_name.startswith("model.language_model."):
            return super()._map_name("model." + hf_name.removeprefix("model.language_model."))
        for prefix in ("model.visual.", "visual."):
            if hf_name.startswith(prefix):
                return f"visual.{hf_name[len(prefix) :]}", None, 1
        return super()._map_name(hf_name)
