"""Where a model's files are: ``resolve_model_path``, without torch.

The HTTP front end needs the path (for the tokenizer and the arch config)
but never the model stack, so this lives apart from ``loader``.
"""

from __future__ import annotations

from pathlib import Path

from tokenloom.default_model import default_model_path

_SUPPORTED = "a Hugging Face model directory (config.json + *.safetensors) or a .gguf file"


def resolve_model_path(model: str | None) -> Path:
    """Validate ``model`` and return the path to load from; None is the bundled default GGUF."""
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
