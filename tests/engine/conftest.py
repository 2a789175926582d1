"""Engine test fixtures: the default model's tokenizer (cheap) and engines (loaded once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer(default_model_path: Path) -> Any:
    from tokenloom.model.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


# Small cache and context: cheap to allocate, plenty for short prompts.
ENGINE_KWARGS: dict[str, Any] = {"num_blocks": 128, "max_model_len": 512, "log_stats": False}


@pytest.fixture(scope="session")
def llm(default_model_path: Path) -> Any:
    import torch

    from tokenloom.engine.llm import LLM

    torch.set_num_threads(2)
    return LLM(str(default_model_path), **ENGINE_KWARGS)
