"""Engine test fixtures: the default model's tokenizer (cheap) and engines (loaded once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer(default_model_path: Path) -> Any:
    from tokenloom.model.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)
