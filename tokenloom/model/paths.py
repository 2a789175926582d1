"""Where a model's files are: ``resolve_model_path``, without torch.

The HTTP front end needs the path (for the tokenizer and the arch config)
but never the model stack, so this lives apart from ``loader``.
"""

from __future__ import annotations

from pathlib import Path

from tokenloom.default_model import default_model_path
from tokenloom.model.hub import looks_like_hub_id, resolve_hub_model

_SUPPORTED = (
    "a Hugging Face model directory (config.json + *.safetensors), a .gguf file "
    "or a Hugging Face id (org/name)"
)


def resolve_model_path(
    model: str | None, revision: str | None = None, need_weights: bool = True
) -> Path:
    """Validate ``model`` and return the path to load from; None is the bundled default
    GGUF, and a Hugging Face id (``org/name``) is resolved at ``revision`` by ``hub``.
    ``need_weights=False`` (``--load-format dummy``) accepts a directory with a
    config.json and no weights."""
    if model is None:
        return default_model_path()
    if looks_like_hub_id(model):
        model = str(resolve_hub_model(model, revision))
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path} (expected {_SUPPORTED})")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json (expected {_SUPPORTED})")
        if need_weights and not any(path.glob("*.safetensors")):
            raise ValueError(
                f"model directory {path} has no *.safetensors files (expected {_SUPPORTED})"
            )
        return path
    if path.suffix != ".gguf":
        raise ValueError(f"unsupported model file {path} (expected {_SUPPORTED})")
    return path
