"""The architecture of a checkpoint, read cheaply (no tensors).

``load_arch_config(path) -> ModelArchConfig`` reads ``config.json`` (plus
``generation_config.json`` for extra EOS ids) from a Hugging Face directory, or
the metadata of a ``.gguf`` file. Both spellings of RoPE settings are accepted:
transformers 5's ``rope_parameters`` and the older ``rope_theta`` +
``rope_scaling``. ``rope_scaling`` is normalised to None (plain RoPE) or a dict
with a ``rope_type`` key among ``SUPPORTED_ROPE_TYPES``.

Family-specific settings (Gemma's soft-capping and per-layer sliding windows,
Qwen3's q/k norms, Phi-3's long-rope factors) are read by ``arch_families``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# "freq_factors" is llama.cpp's way of storing llama3 scaling: per-frequency divisors.
SUPPORTED_ROPE_TYPES = ("linear", "llama3", "freq_factors", "yarn", "dynamic", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelArchConfig:
    """Shapes and constants of a decoder-only Llama-family model."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    # Window of the sliding-window layers (the last ``sliding_window`` positions,
    # the query's own included); ``layer_windows[i]`` is layer i's window or None
    # for full attention (an empty tuple: every layer full).
    sliding_window: int | None = None
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 when set (Gemma),
    # else head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None
    partial_rotary_factor: float = 1.0  # share of head_dim that RoPE rotates
    # RoPE of the sliding-window layers when it differs from the global one (Gemma 3).
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None

    def layer_window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def attention_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return float(base) ** -0.5


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


def _normalise_rope(rope: dict[str, Any] | None, source: str) -> dict[str, Any] | None:
    if not rope:
        return None
    rope = dict(rope)
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("rope_theta", None)
    rope.pop("partial_rotary_factor", None)
    if rope_type == "su":  # Phi-3's first name for longrope
        rope_type = "longrope"
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r} in {source}; "
            f"supported: default, {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "linear" and float(rope.get("factor", 1.0)) == 1.0:
        return None
    return {"rope_type": rope_type, **rope}


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
    cfg = json.loads(config_file.read_text())
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(cfg.get("model_type", ""), "")
    _check_architecture(arch or f"model_type={cfg.get('model_type')!r}", str(config_file))
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"unsupported hidden_act {act!r} in {config_file}; "
            f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    if cfg.get("mlp_bias", False):
        raise ValueError(f"unsupported mlp_bias=true in {config_file}")

    rope_theta, rope_scaling = _read_rope(cfg, str(config_file))

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
        attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        bos_token_id=next(iter(_id_list(cfg.get("bos_token_id"))), None),
        eos_token_ids=eos,
        hidden_act=act,
    )
    from tokenloom.model.arch_families import family_settings

    return family_settings(base, cfg, str(config_file))


def _read_rope(cfg: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, normalised scaling) of the global layers; Gemma 3's per-layer-type
    ``rope_parameters`` are split by ``arch_families``."""
    rope_params = cfg.get("rope_parameters")
    if rope_params is not None and "full_attention" in rope_params:
        rope_params = rope_params["full_attention"]
    if rope_params is not None:
        theta = float(rope_params.get("rope_theta", cfg.get("rope_theta") or 10000.0))
        return theta, _normalise_rope(rope_params, source)
    theta = float(cfg.get("rope_theta") or 10000.0)
    return theta, _normalise_rope(cfg.get("rope_scaling"), source)


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
        rope_scaling = _normalise_rope(
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
