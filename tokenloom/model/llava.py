"""LLaVA: a CLIP or SigLIP vision tower, an MLP projector, and a Llama-family text model.

The text model is this package's ``CausalLM``; ``embed_images`` turns images
into one embedding per placeholder token, which the runner writes over the
placeholders' token embeddings (``inputs_embeds``). Checkpoint names are
transformers' in either layout (``language_model.model.*``, ``vision_tower.*``,
``multi_modal_projector.*``, or the same under ``model.``).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.llama import CausalLM
from tokenloom.model.vision.clip import VisionTransformer, _activation
from tokenloom.multimodal.families import llava_feature_layers

# Prefixes of the text model's tensors, and the names CausalLM reads them under.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.")


class LlavaProjector(nn.Module):
    def __init__(
        self, vision_width: int, text_width: int, act: str, bias: bool, dtype: torch.dtype
    ):
        super().__init__()
        self.linear_1 = nn.Linear(vision_width, text_width, bias=bias, dtype=dtype)
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias, dtype=dtype)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(CausalLM):
    """``embed_images([{"pixel_values": [1, C, H, W]}, ...])`` -> one [tokens, hidden]
    tensor per image; the rest is the text model's."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__(arch, dtype)
        vision = arch.vision
        assert vision is not None
        self.feature_layers = llava_feature_layers(vision)
        self.drop_first = (
            vision.config.get("vision_feature_select_strategy", "default") == "default"
        )
        cfg = vision.vision_config
        self.vision_tower = VisionTransformer(cfg, max(self.feature_layers), dtype)
        self.multi_modal_projector = LlavaProjector(
            int(cfg["hidden_size"]) * len(self.feature_layers),
            arch.hidden_size,
            str(vision.config.get("projector_hidden_act", "gelu")),
            bool(vision.config.get("multimodal_projector_bias", True)),
            dtype,
        )

    def embed_images(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixels = torch.cat(
            [item["pixel_values"].reshape(-1, *item["pixel_values"].shape[-3:]) for item in items]
        )
        states = self.vision_tower(pixels)
        features = [states[layer] for layer in self.feature_layers]
        if self.drop_first:
            features = [f[:, 1:] for f in features]
        return list(self.multi_modal_projector(torch.cat(features, dim=-1)))

    def _map_name(self, hf_name: str) -> tuple[str, int | None, int] | None:
        for old, new in _TEXT_PREFIXES:
            if hf_name.startswith(old):
                return super()._map_name(new + hf_name[len(old) :])
        for prefix in ("model.vision_tower.", "vision_tower."):
            if hf_name.startswith(prefix):
                rest = hf_name[len(prefix) :].removeprefix("vision_model.")
                layer = _VISION_LAYER.match(rest)
                if rest.startswith(("post_layernorm.", "head.")) or (
                    layer is not None
                    and int(layer.group(1)) >= len(self.vision_tower.encoder.layers)
                ):
                    return None  # past the deepest hidden state LLaVA reads
                return f"vision_tower.{rest}", None, 1
        for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
            if hf_name.startswith(prefix):
                return f"multi_modal_projector.{hf_name[len(prefix) :]}", None, 1
        return super()._map_name(hf_name)
