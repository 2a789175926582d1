"""RoPE settings from a ``config.json``, normalised (torch-free).

Both spellings are accepted: transformers 5's ``rope_parameters`` and the older
``rope_theta`` + ``rope_scaling``.
"""

from __future__ import annotations

from typing import Any

from tokenloom.model.arch_config import SUPPORTED_ROPE_TYPES


def normalise_rope(rope: dict[str, Any] | None, source: str) -> dict[str, Any] | None:
    """None (plain RoPE) or a dict with a ``rope_type`` among ``SUPPORTED_ROPE_TYPES``
    and the type's own keys; accepts both of transformers' spellings."""
    if not rope:
        return None
    rope = dict(rope)
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("rope_theta", None)
    rope.pop("partial_rotary_factor", None)
    # Multimodal RoPE's split over (time, height, width) positions is read apart
    # (arch_families.vision_settings); its frequencies are plain RoPE's.
    rope.pop("mrope_section", None)
    rope.pop("mrope_interleaved", None)
    if rope_type == "su":  # Phi-3's first name for longrope
        rope_type = "longrope"
    if rope_type in ("default", "mrope"):
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r} in {source}; "
            f"supported: default, {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "linear" and float(rope.get("factor", 1.0)) == 1.0:
        return None
    return {"rope_type": rope_type, **rope}


def read_rope(cfg: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, normalised scaling) of the global layers; Gemma 3's per-layer-type
    ``rope_parameters`` are split by ``arch_families``."""
    rope_params = cfg.get("rope_parameters")
    if rope_params is not None and "full_attention" in rope_params:
        rope_params = rope_params["full_attention"]
    if rope_params is not None:
        theta = float(rope_params.get("rope_theta", cfg.get("rope_theta") or 10000.0))
        return theta, normalise_rope(rope_params, source)
    theta = float(cfg.get("rope_theta") or 10000.0)
    return theta, normalise_rope(cfg.get("rope_scaling"), source)
