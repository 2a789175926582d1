"""Reading JSON Lines files of user records (prompts for ``generate`` and ``bench``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, record)`` for each non-blank line.

    A line that is not JSON raises ``ValueError`` naming the file and line.
    """
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON: {exc}") from exc
