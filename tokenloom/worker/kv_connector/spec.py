"""The KV cache's identity for connectors: what a block's bytes mean.

Two engines can exchange KV (through a disk tier or a transfer) only when
their fingerprints agree: the same weights (the checkpoint files' names,
sizes and modification times, and how they are quantized), the same compute
and KV cache dtypes, block size and block layout.
"""

from __future__ import annotations

import json
from hashlib import blake2b
from pathlib import Path

import torch

from tokenloom.kv_transfer.base import KVCacheSpec

_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".json")


def kv_cache_spec(
    model_path: str | Path,
    quantization: str | None,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    block_size: int,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
) -> KVCacheSpec:
    path = Path(model_path).resolve()
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
    )
    identity = {
        "model": str(path),
        "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        "quantization": quantization,
        "dtype": str(dtype),
        "kv_cache_dtype": str(kv_cache_dtype),
        "block_size": block_size,
        "blocks": [[list(t.shape[1:]), str(t.dtype)] for pair in kv_caches for t in pair],
    }
    fingerprint = blake2b(json.dumps(identity).encode(), digest_size=16).hexdigest()
    first = kv_caches[0][0]
    dtype_name = str(dtype).removeprefix("torch.")
    kv_name = str(kv_cache_dtype).removeprefix("torch.")
    return KVCacheSpec(
        fingerprint=fingerprint,
        description=f"{path.name} {dtype_name}, KV cache {kv_name}, {block_size}-token blocks",
        block_size=block_size,
        num_layers=len(kv_caches),
        layer_bytes=first[0].numel() * first.element_size(),
    )
