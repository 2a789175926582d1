"""The model families, one row each, and what each adds to the Llama fields of a
Hugging Face ``config.json`` (torch-free).

``FAMILIES`` is the one table of per-family traits: the names a checkpoint
gives its family, which decoder class runs it, and the fixed traits the rest
of the code reads (always-on q/k/v biases, fused projections in the
checkpoint, q/k norms). ``family_settings(base, cfg, source)`` completes the
fields ``arch_reader`` reads with what each family adds:

- sliding windows per layer: Mistral and Phi-3 window every layer, Gemma 2
  alternates sliding and global layers, Gemma 3 has one global layer in
  ``sliding_window_pattern``, Qwen2/Qwen3 window the layers from
  ``max_window_layers`` when ``use_sliding_window``; an explicit
  ``layer_types`` list wins over these defaults;
- Qwen3 and Gemma 3: per-head RMSNorm of q and k;
- Gemma: attention scale from ``query_pre_attn_scalar``, soft-capping of
  attention scores and final logits, and (Gemma 3) a separate RoPE base for the
  sliding layers;
- Phi-3: ``partial_rotary_factor`` and long-rope factors;
- vision-language models (LLaVA, Qwen2.5-VL): the text model's fields come from
  ``text_config`` with the traits of its text family, the vision tower's from
  the rest (``multimodal.families.VisionArch``), and Qwen2.5-VL's multimodal
  RoPE sections from its rope parameters;
- the context length served with YaRN and dynamic scaling (the original length
  times the factor, as vLLM derives it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.rope_config import normalise_rope
from tokenloom.multimodal.families import VisionKind, read_vision_arch


@dataclass(frozen=True)
class Family:
    """One model family: how checkpoints name it and the traits that set it apart."""

    architecture: str  # config.json's "architectures" entry
    model_type: str  # config.json's "model_type"
    # The decoder class that runs it (``registry.model_class``).
    decoder: Literal["llama", "gemma", "llava", "qwen2_5_vl"] = "llama"
    gguf_name: str | None = None  # a GGUF file's general.architecture
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE
    attention_bias: bool = False  # q/k/v biases whatever config.json says
    # q/k/v stored as one qkv_proj, gate/up as one gate_up_proj.
    fused_checkpoint_projections: bool = False
    # Sliding windows only where config.json sets use_sliding_window.
    windows_opt_in: bool = False
    # Vision-language: the vision family, and the family whose traits its text model
    # has (None: the one text_config's model_type names).
    vision: VisionKind | None = None
    text_family: str | None = None


FAMILIES: dict[str, Family] = {
    family.architecture: family
    for family in (
        Family("LlamaForCausalLM", "llama", gguf_name="llama"),
        Family("MistralForCausalLM", "mistral"),
        Family(
            "Qwen2ForCausalLM", "qwen2", gguf_name="qwen2", attention_bias=True, windows_opt_in=True
        ),
        Family("Qwen3ForCausalLM", "qwen3", qk_norm=True, windows_opt_in=True),
        Family("Gemma2ForCausalLM", "gemma2", decoder="gemma"),
        Family("Gemma3ForCausalLM", "gemma3_text", decoder="gemma", qk_norm=True),
        Family("Phi3ForCausalLM", "phi3", fused_checkpoint_projections=True),
        Family("LlavaForConditionalGeneration", "llava", decoder="llava", vision="llava"),
        Family(
            "Qwen2_5_VLForConditionalGeneration",
            "qwen2_5_vl",
            decoder="qwen2_5_vl",
            vision="qwen2_5_vl",
            text_family="Qwen2ForCausalLM",
        ),
    )
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
MODEL_TYPE_TO_ARCH = {f.model_type: f.architecture for f in FAMILIES.values()}
GGUF_ARCHITECTURES = {f.gguf_name: f.architecture for f in FAMILIES.values() if f.gguf_name}


def text_family(architecture: str, cfg: dict[str, Any], source: str) -> str:
    """The family whose traits a checkpoint's text model has: its own, or a
    vision-language family's text model's (``text_config``)."""
    family = FAMILIES[architecture]
    if family.vision is None:
        return architecture
    if family.text_family is not None:
        return family.text_family
    text_type = (cfg.get("text_config") or {}).get("model_type", "llama")
    text_arch = MODEL_TYPE_TO_ARCH.get(text_type)
    if text_arch is None or FAMILIES[text_arch].vision is not None:
        raise ValueError(f"unsupported text model {text_type!r} in {source}")
    return text_arch


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's settings: ``text_config`` over the top level (older
    vision-language checkpoints keep them at the top level)."""
    nested = cfg.get("text_config")
    if not isinstance(nested, dict):
        return cfg
    outer = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    return {**outer, **nested}


def vision_settings(
    text_arch: ModelArchConfig, architecture: str, cfg: dict[str, Any], source: str
) -> ModelArchConfig:
    """A vision-language model's arch: its text model's (``text_arch``, read from
    ``text_config``) with the vision tower and multimodal RoPE added."""
    family = FAMILIES[architecture]
    assert family.vision is not None
    changes: dict[str, Any] = {
        "architecture": architecture,
        "vision": read_vision_arch(family.vision, cfg, source),
    }
    if family.vision == "qwen2_5_vl":
        text = text_config(cfg)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        section = rope.get("mrope_section")
        half = int(text_arch.head_dim * text_arch.partial_rotary_factor) // 2
        if not section or sum(section) != half:
            raise ValueError(
                f"mrope_section in {source} must split the {half} rotary frequencies, got {section}"
            )
        changes["mrope_section"] = tuple(int(n) for n in section)
    if "tie_word_embeddings" in cfg:  # the top level wins over text_config's
        changes["tie_word_embeddings"] = bool(cfg["tie_word_embeddings"])
    return dataclasses.replace(text_arch, **changes)


def family_settings(base: ModelArchConfig, cfg: dict[str, Any], source: str) -> ModelArchConfig:
    arch = base.architecture
    family = FAMILIES[arch]
    changes: dict[str, Any] = {
        "qk_norm": family.qk_norm,
        "fused_checkpoint_projections": family.fused_checkpoint_projections,
    }
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"bidirectional attention (use_bidirectional_attention) in {source}")
    changes.update(_windows(base, cfg, source))
    if family.decoder == "gemma":
        changes["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", True))
        scalar = cfg.get("query_pre_attn_scalar")
        changes["query_pre_attn_scalar"] = float(scalar) if scalar else None
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = cfg.get(key)
            changes[key] = float(value) if value else None
    if arch == "Gemma3ForCausalLM":
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention")
        if local is not None:
            changes["local_rope_theta"] = float(local.get("rope_theta", 10000.0))
            changes["local_rope_scaling"] = normalise_rope(local, source)
        else:
            changes["local_rope_theta"] = float(cfg.get("rope_local_base_freq") or 10000.0)
    partial = cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get(
        "partial_rotary_factor"
    )
    if partial is not None:
        partial = float(partial)
        if not 0.0 < partial <= 1.0 or int(base.head_dim * partial) % 2:
            raise ValueError(
                f"partial_rotary_factor {partial} in {source} must be in (0, 1] and rotate an "
                f"even number of the {base.head_dim} head dimensions"
            )
        changes["partial_rotary_factor"] = partial
    if base.rope_scaling is not None:
        rope, max_pos = _complete_scaling(base, cfg, source, float(partial or 1.0))
        changes["rope_scaling"] = rope
        changes["max_position_embeddings"] = max_pos
    return dataclasses.replace(base, **changes)


def _windows(base: ModelArchConfig, cfg: dict[str, Any], source: str) -> dict[str, Any]:
    arch, num_layers = base.architecture, base.num_hidden_layers
    window = cfg.get("sliding_window")
    if FAMILIES[arch].windows_opt_in and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return {"sliding_window": None, "layer_windows": ()}
    window = int(window)
    if window < 1:
        raise ValueError(f"sliding_window must be >= 1 in {source}, got {window}")
    kinds = cfg.get("layer_types")
    if not kinds:
        if arch == "Gemma2ForCausalLM":
            kinds = ["sliding_attention" if i % 2 == 0 else "full" for i in range(num_layers)]
        elif arch == "Gemma3ForCausalLM":
            pattern = int(cfg.get("sliding_window_pattern", 6))
            kinds = [
                "sliding_attention" if (i + 1) % pattern else "full" for i in range(num_layers)
            ]
        elif FAMILIES[arch].windows_opt_in:
            first = int(cfg.get("max_window_layers", 0))
            kinds = ["sliding_attention" if i >= first else "full" for i in range(num_layers)]
        else:
            kinds = ["sliding_attention"] * num_layers
    if len(kinds) != num_layers:
        raise ValueError(
            f"layer_types in {source} has {len(kinds)} entries for {num_layers} layers"
        )
    windows = tuple(window if kind == "sliding_attention" else None for kind in kinds)
    if all(w is None for w in windows):
        return {"sliding_window": None, "layer_windows": ()}
    return {"sliding_window": window, "layer_windows": windows}


def _complete_scaling(
    base: ModelArchConfig, cfg: dict[str, Any], source: str, partial: float
) -> tuple[dict[str, Any], int]:
    """Fill the scaling dict with the lengths the RoPE table needs; returns it with
    the context length to serve."""
    rope = dict(base.rope_scaling or {})
    kind = rope["rope_type"]
    max_pos = base.max_position_embeddings
    if kind not in ("yarn", "dynamic", "longrope"):
        return rope, max_pos
    if kind == "dynamic":
        # transformers rescales beyond max_position_embeddings, up to factor times it.
        rope["original_max_position_embeddings"] = max_pos
        return rope, int(max_pos * float(rope["factor"]))
    original = rope.get("original_max_position_embeddings") or cfg.get(
        "original_max_position_embeddings"
    )
    original = int(original or max_pos)
    rope["original_max_position_embeddings"] = original
    rope["max_position_embeddings"] = max_pos
    if kind == "longrope":
        half = int(base.head_dim * partial) // 2
        for key in ("short_factor", "long_factor"):
            if len(rope.get(key) or ()) != half:
                raise ValueError(f"longrope {key} in {source} must have {half} entries")
        return rope, max_pos
    if rope.get("factor") is None:
        rope["factor"] = max_pos / original
    return rope, max(max_pos, int(original * float(rope["factor"])))
