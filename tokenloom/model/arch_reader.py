"""Reading a checkpoint's architecture cheaply (no tensors, no torch).

``load_arch_config(path) -> ModelArchConfig`` reads ``config.json`` (plus
``generation_config.json`` for extra EOS ids) from a Hugging Face directory, or
the metadata of a ``.gguf`` file; ``arch_families.family_settings`` adds what
the family has beyond the Llama fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenloom.model.arch_config import SUPPORTED_ACTIVATIONS, ModelArchConfig
from tokenloom.model.arch_families import (
    FAMILIES,
    GGUF_ARCHITECTURES,
    MODEL_TYPE_TO_ARCH,
    SUPPORTED_ARCHITECTURES,
    family_settings,
    text_config,
    text_family,
    vision_settings,
)
from tokenloom.model.rope_config import normalise_rope, read_rope


def load_arch_config(path: str | Path) -> ModelArchConfig:
    """Read the architecture of a HF model directory or a .gguf file."""
    path = Path(path)
    if path.is_dir():
        return _from_hf_dir(path)
    if path.suffix == ".gguf" and path.is_file():
        return _from_gguf(path)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    raise ValueError(
        f"unsupported model path {path}: expected a Hugging Face model directory "
        "(config.json + *.safetensors) or a .gguf file"
    )


def _check_architecture(arch: str, source: str) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {arch!r} in {source}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _from_hf_dir(path: Path) -> ModelArchConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    full_cfg = json.loads(config_file.read_text())
    archs = full_cfg.get("architectures") or []
    arch = archs[0] if archs else MODEL_TYPE_TO_ARCH.get(full_cfg.get("model_type", ""), "")
    _check_architecture(arch or f"model_type={full_cfg.get('model_type')!r}", str(config_file))
    # A vision-language model's text model is read like a text-only one of its family.
    vision_arch, arch = arch, text_family(arch, full_cfg, str(config_file))
    cfg = text_config(full_cfg) if vision_arch != arch else full_cfg
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"unsupported hidden_act {act!r} in {config_file}; "
            f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    if cfg.get("mlp_bias", False):
        raise ValueError(f"unsupported mlp_bias=true in {config_file}")

    rope_theta, rope_scaling = read_rope(cfg, str(config_file))

    eos = _id_list(cfg.get("eos_token_id"))
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        for token in _id_list(json.loads(gen_file.read_text()).get("eos_token_id")):
            if token not in eos:
                eos.append(token)

    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    num_layers = int(cfg["num_hidden_layers"])
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    base = ModelArchConfig(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=max_pos,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=FAMILIES[arch].attention_bias or bool(cfg.get("attention_bias", False)),
        bos_token_id=next(iter(_id_list(cfg.get("bos_token_id"))), None),
        eos_token_ids=eos,
        hidden_act=act,
        checkpoint_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
    )
    text_arch = family_settings(base, cfg, str(config_file))
    if vision_arch != arch:
        return vision_settings(text_arch, vision_arch, full_cfg, str(config_file))
    return text_arch


def _from_gguf(path: Path) -> ModelArchConfig:
    from gguf.quants import dequantize

    from tokenloom.model.gguf_reader import open_gguf

    gguf_file = open_gguf(path)
    meta = gguf_file.metadata
    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {gguf_arch!r} in {path}; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{gguf_arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rope_dims = int(get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"partial rotary embeddings ({rope_dims} of {head_dim}) unsupported")
    tensors = gguf_file.tensor_by_name
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))

    rope_scaling: dict[str, Any] | None = None
    scaling_type = get("rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:
        info = tensors["rope_freqs.weight"]
        with gguf_file.mapped() as data:
            factors = dequantize(data.raw(info), info.ggml_type).ravel().tolist()
        rope_scaling = {"rope_type": "freq_factors", "factors": factors}
    elif scaling_type == "linear":
        rope_scaling = normalise_rope(
            {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}, str(path)
        )
    elif scaling_type not in ("none", None):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r} in {path}")

    eos = _id_list(meta.get("tokenizer.ggml.eos_token_id"))
    for token in _id_list(meta.get("tokenizer.ggml.eot_token_id")):
        if token not in eos:
            eos.append(token)
    return ModelArchConfig(
        architecture=GGUF_ARCHITECTURES[gguf_arch],
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        vocab_size=int(vocab),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos,
    )
