"""How each vision-language family turns an image into placeholder tokens (torch-free).

``VisionArch`` is the vision part of a checkpoint's ``config.json`` (the
model layer keeps it in ``ModelArchConfig.vision``): which family
(``llava``: a CLIP or SigLIP tower and an MLP projector; ``qwen2_5_vl``:
Qwen2.5-VL's windowed tower with dynamic resolution), the placeholder token,
and the raw settings the tower is built from. The functions here answer what
the front end and the scheduler need without the tower: how many tokens a
processed image fills, the most one image can fill, and the text a chat
message shows where an image goes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

VisionKind = Literal["llava", "qwen2_5_vl"]

# Qwen2-VL's image processor defaults (transformers' Qwen2VLImageProcessor).
_QWEN_PATCH, _QWEN_MERGE, _QWEN_MAX_PIXELS = 14, 2, 28 * 28 * 1280


@dataclass(frozen=True)
class VisionArch:
    """The vision side of a vision-language checkpoint.

    ``config`` is its ``config.json`` without ``text_config``: ``vision_config``
    and the family's own keys (LLaVA's ``vision_feature_layer``,
    ``vision_feature_select_strategy``, ``projector_hidden_act``,
    ``multimodal_projector_bias``; Qwen2.5-VL's ``vision_start_token_id``).
    """

    kind: VisionKind
    image_token_id: int
    config: dict[str, Any]

    @property
    def vision_config(self) -> dict[str, Any]:
        return self.config["vision_config"]


def read_vision_arch(kind: VisionKind, cfg: dict[str, Any], source: str) -> VisionArch:
    """The ``VisionArch`` of a ``config.json``; ``ValueError`` naming what is missing."""
    vision = cfg.get("vision_config")
    if not isinstance(vision, dict):
        raise ValueError(f"{source} has no vision_config")
    token = cfg.get("image_token_id", cfg.get("image_token_index"))
    if not isinstance(token, int):
        raise ValueError(f"{source} has no image_token_id")
    config = {k: v for k, v in cfg.items() if k != "text_config"}
    if kind == "llava":
        model_type = vision.get("model_type", "clip_vision_model")
        if model_type not in ("clip_vision_model", "siglip_vision_model"):
            raise ValueError(
                f"unsupported LLaVA vision tower {model_type!r} in {source} "
                "(supported: clip_vision_model, siglip_vision_model)"
            )
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r} in {source}")
    return VisionArch(kind, token, config)


def llava_feature_layers(arch: VisionArch) -> list[int]:
    """The tower's hidden states LLaVA projects, as indices into its hidden-state list
    (0: the embeddings, i: layer i's output), concatenated in this order."""
    layers = arch.config.get("vision_feature_layer", -2)
    layers = [layers] if isinstance(layers, int) else list(layers)
    num_layers = int(arch.vision_config.get("num_hidden_layers", 12))
    return [layer if layer >= 0 else num_layers + 1 + layer for layer in layers]


def llava_tokens_per_image(arch: VisionArch) -> int:
    """Placeholder tokens of one LLaVA image: the tower's patches, plus CLIP's class
    token, less the first token under the ``default`` select strategy."""
    vision = arch.vision_config
    patches = (int(vision.get("image_size", 224)) // int(vision.get("patch_size", 32))) ** 2
    clip = vision.get("model_type", "clip_vision_model") == "clip_vision_model"
    default = arch.config.get("vision_feature_select_strategy", "default") == "default"
    return patches + int(clip) - int(default)


def num_image_tokens(arch: VisionArch, data: dict[str, np.ndarray]) -> int:
    """Placeholder tokens of one processed image (its processor's arrays)."""
    if arch.kind == "llava":
        return llava_tokens_per_image(arch)
    t, h, w = (int(n) for n in data["image_grid_thw"].reshape(-1)[:3])
    merge = int(arch.vision_config.get("spatial_merge_size", _QWEN_MERGE))
    return t * h * w // (merge * merge)


def max_tokens_per_image(arch: VisionArch, model_dir: str | Path) -> int:
    """The most placeholder tokens one image can fill, given the model's image processor
    settings (``preprocessor_config.json``): what the encoder budgets must hold."""
    if arch.kind == "llava":
        return llava_tokens_per_image(arch)
    settings = read_processor_config(model_dir)
    size = settings.get("size") or {}
    max_pixels = settings.get("max_pixels") or size.get("longest_edge") or _QWEN_MAX_PIXELS
    factor = int(settings.get("patch_size", _QWEN_PATCH)) * int(
        settings.get("merge_size", _QWEN_MERGE)
    )
    return int(max_pixels) // (factor * factor)


def read_processor_config(model_dir: str | Path) -> dict[str, Any]:
    """The image processor's settings from a model directory ({} when it has none)."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            settings = json.loads(path.read_text())
            # processor_config.json nests the image processor's settings.
            return settings.get("image_processor", settings)
    return {}


def image_placeholder_text(arch: VisionArch, image_token: str, token_text: dict[int, str]) -> str:
    """What a chat message shows for an image when its template does not place images
    itself: the image token, between Qwen's vision start and end markers."""
    if arch.kind == "qwen2_5_vl":
        start = token_text.get(arch.config.get("vision_start_token_id", -1), "")
        end = token_text.get(arch.config.get("vision_end_token_id", -1), "")
        return f"{start}{image_token}{end}"
    return f"{image_token}\n"
