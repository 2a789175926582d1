"""Reading a Hugging Face directory's safetensors files, one tensor at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
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
