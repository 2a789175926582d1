"""Paged KV cache tensors.

Each layer owns a K tensor ``[num_blocks, num_kv_heads, head_dim, block_size]``
and a V tensor ``[num_blocks, num_kv_heads, block_size, head_dim]``; token slot
``s`` lives in block ``s // block_size`` at offset ``s % block_size`` (K's column,
V's row). Keys are transposed within a block so that attention scores a block
of keys with vector FMAs across keys (``csrc/attention/paged_attention.cpp``); values stay
token-major, the layout the weighted sum reads. Both are head-major within a
block, so one head's K and V are each one run of memory that a decode reads
from start to end: with V's heads interleaved row by row, reading one head's
rows would take every third 128 bytes, a stride the hardware prefetcher does
not follow. Block 0 is the scheduler's reserved null
block: padded block-table entries point at it, so it must exist but is never read
unmasked.
"""

from __future__ import annotations

import torch

from tokenloom.model import huge_pages
from tokenloom.model.arch_config import ModelArchConfig


def kv_cache_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    per_layer = 2 * block_size * arch.num_key_value_heads * arch.head_dim * dtype.itemsize
    return per_layer * arch.num_hidden_layers


def allocate_kv_caches(
    arch: ModelArchConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (K, V) per layer; zeros keep masked-out padding finite. On the CPU they
    sit on huge pages (``huge_pages``): attention reads blocks scattered over them."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    heads, dim = arch.num_key_value_heads, arch.head_dim
    return [
        (
            huge_pages.zeros((num_blocks, heads, dim, block_size), dtype, device),
            huge_pages.zeros((num_blocks, heads, block_size, dim), dtype, device),
        )
        for _ in range(arch.num_hidden_layers)
    ]
