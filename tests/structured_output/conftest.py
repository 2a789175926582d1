"""The default model's tokenizer: what grammars are compiled against (cheap to load)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer(default_model_path: Path) -> Any:
    from tokenloom.model.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)
