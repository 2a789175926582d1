"""Paged KV cache tensors.

Each layer owns a K and a V tensor of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; token slot ``s`` lives at
``(s // block_size, s % block_size)``. Block 0 is the scheduler's reserved null
block: padded block-table entries point at it, so it must exist but is never read
unmasked.
"""

from __future__ import annotations

import torch

from tokenloom.model.arch_config import ModelArchConfig


def kv_cache_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * arch.num_key_value_heads * arch.head_dim * elem
    return per_layer * arch.num_hidden_layers


def allocate_kv_caches(
    arch: ModelArchConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (K, V) per layer; zeros keep masked-out padding finite."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(arch.num_hidden_layers)
    ]
