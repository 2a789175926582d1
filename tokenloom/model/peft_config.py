"""Reading a PEFT LoRA adapter directory's ``adapter_config.json`` (torch-free, so
the server can reject a bad adapter before it reaches the engine).

An adapter directory holds ``adapter_config.json`` and
``adapter_model.safetensors``. Supported: plain LoRA (``peft_type`` LORA) on the
attention and MLP projections, ``lora_alpha / r`` scaling or rsLoRA's
``lora_alpha / sqrt(r)``, no bias, no DoRA, no extra trained modules.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from tokenloom.model.arch_config import ModelArchConfig

# The projections LoRA may target, by their Hugging Face module names (Phi-3
# checkpoints fuse qkv_proj and gate_up_proj).
LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)


@dataclass(frozen=True)
class PeftAdapterConfig:
    path: Path
    rank: int
    scaling: float  # multiplies B @ A
    target_modules: tuple[str, ...]


def read_peft_config(path: str | Path, max_lora_rank: int) -> PeftAdapterConfig:
    """Validate an adapter directory; errors name the path and what is wrong."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ValueError(f"LoRA adapter path {path} is not a directory")
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {path} has no adapter_config.json")
    if not (path / "adapter_model.safetensors").is_file():
        raise ValueError(
            f"LoRA adapter {path} has no adapter_model.safetensors (only safetensors "
            "weights are read)"
        )
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {config_file} is not valid JSON: {e}") from None
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type {peft_type!r} is not LORA")
    rank = int(cfg.get("r", 0))
    if rank < 1:
        raise ValueError(f"LoRA adapter {path}: rank r must be >= 1, got {rank}")
    if rank > max_lora_rank:
        raise ValueError(
            f"LoRA adapter {path} has rank {rank}, above max_lora_rank={max_lora_rank} "
            "(raise --max-lora-rank)"
        )
    for key, bad in (
        ("use_dora", True),
        ("modules_to_save", None),
        ("rank_pattern", None),
        ("alpha_pattern", None),
    ):
        value = cfg.get(key)
        if (bad is True and value) or (bad is None and value):
            raise ValueError(f"LoRA adapter {path}: {key}={value!r} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path}: bias={cfg['bias']!r} is not supported")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError(
            f"LoRA adapter {path}: target_modules as a pattern ({targets!r}) is not "
            "supported; list the module names"
        )
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown:
        raise ValueError(
            f"LoRA adapter {path} targets {', '.join(unknown)}; supported: "
            f"{', '.join(LORA_TARGETS)}"
        )
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return PeftAdapterConfig(path, rank, scaling, tuple(targets))


_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.language_model\.|language_model\.model\.|model\.)"
    r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(lora_[AB])\.weight$"
)
# A vision-language model's text model, as transformers names it (both layouts).
_TEXT_MODEL = re.compile(r"^(?:model\.language_model|language_model\.model)\.")


def text_module_path(name: str) -> str:
    """An adapter's module path with a vision-language model's text model prefix
    (``model.language_model.``) read as a text model's (``model.``): adapters apply
    to the text model only."""
    return _TEXT_MODEL.sub("model.", name, count=1)


def expected_shapes(
    arch: ModelArchConfig, module: str, rank: int
) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(A, B) shapes of a LoRA on ``module`` of this architecture; None if it has no such module."""
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    fused = arch.fused_checkpoint_projections
    dims = {"o_proj": (q, hidden), "down_proj": (inter, hidden)}
    if fused:
        dims |= {"qkv_proj": (hidden, q + 2 * kv), "gate_up_proj": (hidden, 2 * inter)}
    else:
        dims |= {
            "q_proj": (hidden, q),
            "k_proj": (hidden, kv),
            "v_proj": (hidden, kv),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
        }
    if module not in dims:
        return None
    fan_in, fan_out = dims[module]
    return (rank, fan_in), (fan_out, rank)


def safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header, without reading the data."""
    with file.open("rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file} is not a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > 100_000_000:
            raise ValueError(f"{file} is not a safetensors file")
        try:
            header = json.loads(handle.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{file} is not a safetensors file") from None
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def validate_adapter(
    path: str | Path, max_lora_rank: int, arch: ModelArchConfig
) -> PeftAdapterConfig:
    """``read_peft_config`` plus a check of every tensor's name and shape against the
    base model, so that an adapter accepted here loads in the engine."""
    config = read_peft_config(path, max_lora_rank)
    shapes = safetensors_shapes(config.path / "adapter_model.safetensors")
    if not shapes:
        raise ValueError(f"LoRA adapter {config.path} has no tensors")
    for name, shape in shapes.items():
        match = _TENSOR.match(name)
        if match is None:
            raise ValueError(f"LoRA adapter {config.path}: unsupported tensor {name}")
        layer, module, kind = int(match.group(1)), match.group(3), match.group(4)
        expected = expected_shapes(arch, module, config.rank)
        if expected is None or layer >= arch.num_hidden_layers:
            raise ValueError(
                f"LoRA adapter {config.path} targets {name}, which this "
                f"{arch.architecture} model does not have"
            )
        want = expected[0] if kind == "lora_A" else expected[1]
        if shape != want:
            raise ValueError(
                f"LoRA adapter {config.path}: {name} has shape {shape}, the base model "
                f"needs {want} (an adapter for another model?)"
            )
    return config
