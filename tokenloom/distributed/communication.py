"""Collectives over the tensor-parallel group, in the shapes the layers need."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place; returns it."""
    dist.all_reduce(tensor)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the last dimension, rank order;
    rank r's last dimension is ``sizes[r]`` (uneven: padded for the exchange)."""
    widest = max(sizes)
    local = tensor
    if tensor.shape[-1] < widest:
        local = torch.nn.functional.pad(tensor, (0, widest - tensor.shape[-1]))
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in sizes]
    dist.all_gather(parts, local)
    return torch.cat([part[..., :size] for part, size in zip(parts, sizes, strict=True)], dim=-1)


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest ``value`` any rank holds (ranks agreeing on a cache size)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())
