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
from dataclasses import dataclass
from pathlib import Path

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
        raise FileNotFoundError(f"LoRA adapter path {path} is not a directory")
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"LoRA adapter {path} has no adapter_config.json")
    if not (path / "adapter_model.safetensors").is_file():
        raise FileNotFoundError(
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
