"""Session-scoped models for the e2e model tests (each loaded once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenloom.config import ModelConfig
from tokenloom.model_loader.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def gguf_model() -> LoadedModel:
    """tokenloom's own load of the default GGUF, in fp32."""
    return load_model(ModelConfig(model=None, dtype="float32"))


@pytest.fixture(scope="session")
def hf_reference(default_hf_model_dir: Path) -> torch.nn.Module:
    """transformers' model of the same weights (dequantised by transformers)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_hf_model_dir, dtype=torch.float32).eval()
