"""CLIP and SigLIP vision transformers, as LLaVA uses them.

LLaVA reads hidden states from inside the tower (``vision_feature_layer``,
-2 by default), so the tower is built only up to the deepest layer read and
returns the hidden-state list (0: the embeddings after CLIP's
``pre_layrnorm``; i: layer i's output), like transformers' ``hidden_states``.
The layers past it, the post-layernorm and SigLIP's pooling head are never
read, so the loader skips their tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _activation(name: str) -> Any:
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported vision activation {name!r}")


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one image's tokens (batched)."""

    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.k_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.v_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.out_proj = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        shape = (batch, length, self.heads, hidden // self.heads)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, hidden))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate, dtype=dtype)
        self.fc2 = nn.Linear(intermediate, hidden, dtype=dtype)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    """Pre-norm transformer layer (CLIP's and SigLIP's are the same)."""

    def __init__(self, cfg: dict[str, Any], eps: float, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.self_attn = VisionAttention(hidden, int(cfg["num_attention_heads"]), dtype)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.mlp = VisionMLP(hidden, int(cfg["intermediate_size"]), act, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(
        self, cfg: dict[str, Any], num_layers: int, eps: float, act: str, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg, eps, act, dtype) for _ in range(num_layers))


class PatchEmbeddings(nn.Module):
    """Patches (plus CLIP's class token) and learned position embeddings."""

    def __init__(self, cfg: dict[str, Any], class_token: bool, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        patch = int(cfg["patch_size"])
        self.patch_embedding = nn.Conv2d(
            int(cfg.get("num_channels", 3)),
            hidden,
            kernel_size=patch,
            stride=patch,
            bias=not class_token,  # SigLIP's patch convolution has a bias, CLIP's none
            dtype=dtype,
        )
        num_positions = (int(cfg["image_size"]) // patch) ** 2 + int(class_token)
        self.class_embedding = (
            nn.Parameter(torch.empty(hidden, dtype=dtype)) if class_token else None
        )
        self.position_embedding = nn.Embedding(num_positions, hidden, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            cls = self.class_embedding.expand(patches.shape[0], 1, -1)
            patches = torch.cat([cls, patches], dim=1)
        return patches + self.position_embedding.weight[: patches.shape[1]]


class VisionTransformer(nn.Module):
    """CLIP (``clip_vision_model``) or SigLIP (``siglip_vision_model``) tower, built up to
    layer ``num_layers``; ``forward`` returns the hidden states 0..num_layers."""

    def __init__(self, cfg: dict[str, Any], num_layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        clip = cfg.get("model_type", "clip_vision_model") == "clip_vision_model"
        hidden = int(cfg["hidden_size"])
        eps = float(cfg.get("layer_norm_eps", 1e-5 if clip else 1e-6))
        act = str(cfg.get("hidden_act", "quick_gelu" if clip else "gelu_pytorch_tanh"))
        image_size = int(cfg["image_size"])
        self.image_size = image_size
        self.embeddings = PatchEmbeddings(cfg, class_token=clip, dtype=dtype)
        # CLIP's name, typo included (the checkpoints spell it so).
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=eps, dtype=dtype) if clip else None
        self.encoder = Encoder(cfg, num_layers, eps, act, dtype)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [B, C, H, W] -> hidden states, each [B, tokens, hidden]."""
        if pixel_values.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(
                f"images must be {self.image_size}x{self.image_size} pixels for this tower, "
                f"got {tuple(pixel_values.shape[-2:])}"
            )
        h = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            h = self.pre_layrnorm(h)
        states = [h]
        for layer in self.encoder.layers:
            h = layer(h)
            states.append(h)
        return states
